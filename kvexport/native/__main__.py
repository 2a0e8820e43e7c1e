"""`python -m kvexport.native`: builds the op library and the replay harness (kvexport.native.build)."""

from kvexport.native.build import main

main()
