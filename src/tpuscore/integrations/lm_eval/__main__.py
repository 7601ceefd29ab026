"""The harness's command line with the "tpuscore" model registered:

    python -m tpuscore.integrations.lm_eval run --model tpuscore \
        --model_args pretrained=PATH,dtype=float32 --tasks arc_easy

takes every argument `lm-eval` takes (the harness finds models only in its own registry, and has
no plugin entry point for them, so its `lm-eval` command cannot see "tpuscore").
"""

from lm_eval.__main__ import cli_evaluate

import tpuscore.integrations.lm_eval  # noqa: F401  registers "tpuscore"

if __name__ == "__main__":
    cli_evaluate()
