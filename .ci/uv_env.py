"""Print `export` lines that hand this environment's pip settings to uv.

uv reads UV_* variables, not pip's configuration files or PIP_* variables: without these, uv
would resolve against other indexes, links and constraints than pip does here. Each pip setting
found (`pip config list`: files and PIP_* alike) becomes its uv variable, indexes are weighed as
pip weighs them, and bytecode is compiled at install, as pip does, so that the tests' processes
do not compile what they import.
"""

import shlex
import subprocess
import sys

UV = {
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "cert": "SSL_CERT_FILE",
}

listed = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
)
for line in listed.stdout.splitlines():  # e.g. global.find-links='/opt/wheels'
    key, _, value = line.partition("=")
    if name := UV.get(key.rsplit(".", 1)[-1]):
        print(f"export {name}={shlex.quote(value.strip().strip(chr(39)))}")
# pip takes the best version any index offers; uv, by default, only the first index's that has
# the package at all.
print("export UV_INDEX_STRATEGY=unsafe-best-match")
print("export UV_COMPILE_BYTECODE=1")
