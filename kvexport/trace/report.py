"""Human-readable verify/replay reports (the same table for the Python and C++ runners)."""

from __future__ import annotations


def format_report(report: dict) -> str:
    """Per-step table and a verdict line from a report dict (VerifyReport.to_json or the C++ JSON)."""
    lines = [f"{'step':>4} {'B':>2}  {'description':<46} {'vs cached abs/rel':>19} "
             f"{'vs recompute abs/rel':>21} {'hit':>5} {'new':>5} {'ms':>7}  ok"]
    for s in report["steps"]:
        c, f = s["vs_cached"], s["vs_full"]
        lines.append(
            f"{s['index']:>4} {s['batch_size']:>2}  {s['description'][:46]:<46} "
            f"{c['max_abs']:>9.1e}/{c['max_rel']:<9.1e} {f['max_abs']:>10.1e}/{f['max_rel']:<10.1e} "
            f"{s['hit_tokens']:>5} {s['recomputed_tokens']:>5} {s['latency_ms']:>7.2f}  {'ok' if s['passed'] else 'FAIL'}"
        )
    num_passed = sum(s["passed"] for s in report["steps"])
    verdict = "PASS" if report["passed"] else "FAIL"
    lines.append(f"verdict: {verdict} ({report['runner']}: {num_passed}/{len(report['steps'])} steps within "
                 f"atol {report['atol']:g}, rtol {report['rtol']:g}; {report['files_checked']} files checked)")
    return "\n".join(lines)
