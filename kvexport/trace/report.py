"""Human-readable verify/replay reports (the same table for the Python and C++ runners)."""

from __future__ import annotations

import textwrap

# The description column grows to fit descriptions up to this width; longer ones wrap at word
# boundaries onto continuation lines, so no word is ever cut.
MAX_DESCRIPTION_WIDTH = 60
_INDENT = 4 + 1 + 2 + 2  # the step and B columns and their separators


def _description_width(steps: list[dict]) -> int:
    longest = max((len(s["description"]) for s in steps), default=0)
    return max(len("description"), min(longest, MAX_DESCRIPTION_WIDTH))


def _step_lines(s: dict, width: int) -> list[str]:
    """The step's row, plus continuation lines for the rest of a long description."""
    c, f, r = s["vs_cached"], s["vs_full"], s["vs_reference"]
    parts = textwrap.wrap(s["description"], width, break_long_words=False, break_on_hyphens=False) or [""]
    row = (
        f"{s['index']:>4} {s['batch_size']:>2}  {parts[0]:<{width}} "
        f"{c['max_abs']:>9.1e}/{c['max_rel']:<9.1e} {f['max_abs']:>10.1e}/{f['max_rel']:<10.1e} "
        f"{r['max_abs']:>9.1e} "
        f"{s['hit_tokens']:>5} {s['recomputed_tokens']:>5} {s['latency_ms']:>7.2f}  "
        f"{'ok' if s['passed'] else 'FAIL'}"
    )
    return [row, *(" " * _INDENT + part for part in parts[1:])]


def format_report(report: dict) -> str:
    """Per-step table and a verdict line from a report dict (VerifyReport.to_json or the C++ JSON)."""
    width = _description_width(report["steps"])
    lines = [
        f"{'step':>4} {'B':>2}  {'description':<{width}} {'vs cached abs/rel':>19} "
        f"{'vs recompute abs/rel':>21} {'vs fp32':>9} {'hit':>5} {'new':>5} {'ms':>7}  ok"
    ]
    for s in report["steps"]:
        lines += _step_lines(s, width)
    num_passed = sum(s["passed"] for s in report["steps"])
    verdict = "PASS" if report["passed"] else "FAIL"
    lines.append(
        f"verdict: {verdict} ({report['runner']}: {num_passed}/{len(report['steps'])} steps within "
        f"atol {report['atol']:g}, rtol {report['rtol']:g}; {report['files_checked']} files checked)"
    )
    return "\n".join(lines)
