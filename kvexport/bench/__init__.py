"""`kvexport bench`: speed of the package, the cache and the C++ path, measured side by side."""
