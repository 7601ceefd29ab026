"""Integrations with other tools, the top layer. Each imports its tool only when imported itself,
behind an optional extra: importing tpuscore never imports them.

- `tpuscore.integrations.lm_eval`: lm-evaluation-harness (`pip install -e '.[eval]'`).
- `tpuscore.integrations.ray`: scoring a Ray Data dataset (`pip install -e '.[ray]'`).
"""
