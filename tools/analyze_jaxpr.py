"""Analyze a saved jaxpr or graph: `jaxremat analyze` as a script.

Usage: python tools/analyze_jaxpr.py dump.txt --budget 80% --plot out.png
"""

import sys

from jaxremat._src.cli import main

if __name__ == "__main__":
  sys.exit(main(["analyze", *sys.argv[1:]]))
