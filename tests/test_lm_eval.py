"""lm-evaluation-harness on tpuscore: a local multiple-choice task and a local perplexity task
(tests/data/lm_eval/) through `simple_evaluate`, with the harness's own `hf` model, with
"tpuscore" in process and with the harness's `local-completions` model against the server's
`/v1/completions`, on the same tiny checkpoint, give identical accuracies and every request's
log-likelihood within 1e-4 (float32)."""

import json
import os
import pathlib
import runpy
import shutil
import subprocess
import sys

import lm_eval
import pytest
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from helpers import ServerThread
from hf_reference import BOS, EOS
from tpuscore import Scorer, ValidationError
from tpuscore.api import templates
from tpuscore.integrations.lm_eval import TpuscoreLM
from tpuscore.serving import app as server

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASKS = ["tpuscore_mc", "tpuscore_ppl"]
# Short enough that some multiple-choice requests are truncated from the left and every longer
# document spans several rolling windows; both models get it.
MAX_LENGTH = 48
ATOL = 1e-4
# The server needs a rerank template whose labels are single tokens of the tests' tokenizer.
TEMPLATE = templates.Template(
    name="test", query="{query}\n", item="{item}", item_suffix="?", labels=("y", "n"),
    default_instruction="",
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(checkpoint_dir, tmp_path_factory):
    """The BOS-adding tiny checkpoint, with the tokenizer_config.json a Hugging Face tokenizer
    needs to know its BOS and EOS (the harness's `hf` model starts rolling windows from them)."""
    path = tmp_path_factory.mktemp("lm_eval") / "checkpoint"
    shutil.copytree(checkpoint_dir("llama3_rope_tied"), path)
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def evaluated(checkpoint):
    """simple_evaluate's output per model, with per-request samples: `hf`, `tpuscore` in
    process, and `http` (the harness's local-completions against the server). Run from the
    repository root: the task files name their data relative to it."""
    running = ServerThread(
        server.create_app(
            Scorer.from_pretrained(checkpoint, dtype="float32"), rerank_template=TEMPLATE
        )
    )
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        # The local tasks only: indexing the harness's built-in tasks too takes seconds.
        manager = TaskManager(include_path=str(ROOT / "tests/data/lm_eval"), include_defaults=False)
        local = f"pretrained={checkpoint},dtype=float32,max_length={MAX_LENGTH}"
        # The API model keeps max_length - 1 tokens for a generated one and rolls windows of
        # max_length - 2: MAX_LENGTH + 2 gives the windows and cuts `hf` gets from MAX_LENGTH.
        # add_bos_token: its Hugging Face tokenizer then adds the BOS, as `hf`'s does.
        api = (
            f"model=tiny,base_url={running.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={checkpoint},max_length={MAX_LENGTH + 2},add_bos_token=True,"
            "batch_size=8,tokenized_requests=True"
        )
        models = {"hf": ("hf", local), "tpuscore": ("tpuscore", local)}
        models["http"] = ("local-completions", api)
        return {
            name: lm_eval.simple_evaluate(
                model=model,
                model_args=args,
                tasks=TASKS,
                task_manager=manager,
                device="cpu",
                log_samples=True,
            )
            for name, (model, args) in models.items()
        }
    finally:
        os.chdir(cwd)
        running.stop()


@pytest.mark.parametrize("model", ["tpuscore", "http"])
def test_identical_accuracy_and_perplexity(evaluated, model):
    hf, ours = (evaluated[m]["results"] for m in ("hf", model))
    assert hf["tpuscore_mc"]["sample_len"] == ours["tpuscore_mc"]["sample_len"] == 8
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["tpuscore_mc"][metric] == hf["tpuscore_mc"][metric]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["tpuscore_ppl"][metric] == pytest.approx(hf["tpuscore_ppl"][metric], rel=1e-5)


@pytest.mark.parametrize("model", ["tpuscore", "http"])
@pytest.mark.parametrize("task, requests", [("tpuscore_mc", 32), ("tpuscore_ppl", 4)])
def test_every_request_within_1e_4(evaluated, model, task, requests):
    hf, ours = (evaluated[m]["samples"][task] for m in ("hf", model))
    assert len(hf) == len(ours)
    pairs = [
        (a, b)
        for hf_doc, doc in zip(hf, ours, strict=True)
        for a, b in zip(hf_doc["filtered_resps"], doc["filtered_resps"], strict=True)
    ]
    assert len(pairs) == requests
    for a, b in pairs:
        if task == "tpuscore_mc":  # (logprob, is_greedy)
            assert float(b[0]) == pytest.approx(float(a[0]), abs=ATOL)
            assert bool(b[1]) == bool(a[1])
        else:  # the document's summed log-likelihood
            assert float(b) == pytest.approx(float(a), abs=ATOL)


def instances(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_each_context_runs_once_and_results_keep_request_order(checkpoint, monkeypatch):
    lm = TpuscoreLM(pretrained=str(checkpoint), dtype="float32", max_length=MAX_LENGTH)
    scorer = lm.scorer
    calls = []
    original = scorer.loglikelihood

    def recording(context, continuations, **kwargs):
        calls.append((tuple(context), len(continuations)))
        return original(context, continuations, **kwargs)

    monkeypatch.setattr(scorer, "loglikelihood", recording)
    args = [("The fox", " jumps"), ("A dog", " sat"), ("The fox", " ran far"), ("A dog", " ran")]
    got = lm.loglikelihood(instances("loglikelihood", args))
    assert sorted(n for _, n in calls) == [2, 2]
    assert len({context for context, _ in calls}) == 2
    for (context, continuation), (logprob, greedy) in zip(args, got, strict=True):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        (alone,) = original(context_ids, [continuation_ids])
        assert logprob == pytest.approx(alone.logprob, abs=1e-5)
        assert greedy == alone.is_greedy


def test_a_peft_adapter_scores_under_the_adapter_as_peft_does(checkpoint, tmp_path):
    """`peft=ADAPTER` in the model args, as the `hf` model takes it: every request is scored
    under the LoRA adapter, each within 1e-4 of transformers + peft on the same token ids, and
    the adapter moves every score off the base model's. (Not against the `hf` model itself:
    with `peft=` it resizes the embeddings to the tokenizer's length, which the tiny
    checkpoint's vocabulary deliberately exceeds.)"""
    import peft
    import torch

    from lora_reference import ADAPTERS, fresh_hf, save_adapter

    adapter = save_adapter(checkpoint, tmp_path / "adapter", seed=7, **ADAPTERS["attn_mlp"])
    lm = TpuscoreLM(
        pretrained=str(checkpoint), peft=str(adapter), dtype="float32", max_length=MAX_LENGTH
    )
    reference = peft.PeftModel.from_pretrained(fresh_hf(checkpoint), adapter).eval()

    def continuation_logprob(context_ids, continuation_ids):
        with torch.no_grad():
            logits = reference(torch.tensor([context_ids + continuation_ids])).logits[0]
        rows = logits[len(context_ids) - 1 : -1].log_softmax(-1)
        return float(rows[range(len(continuation_ids)), continuation_ids].sum())

    args = [("The fox", " jumps"), ("A dog", " sat"), ("The fox", " ran far"), ("Once", " a word")]
    got = lm.loglikelihood(instances("loglikelihood", args))
    for (context, continuation), (logprob, _) in zip(args, got, strict=True):
        ids = lm._encode_pair(context, continuation)
        assert logprob == pytest.approx(continuation_logprob(*ids), abs=ATOL)
        with reference.disable_adapter():
            assert abs(logprob - continuation_logprob(*ids)) > 10 * ATOL
    assert lm.get_model_info()["peft"] == str(adapter)


def test_generate_until_says_tpuscore_does_not_generate(checkpoint):
    lm = TpuscoreLM(pretrained=str(checkpoint), dtype="float32")
    request = Instance("generate_until", {}, ("Q: 2 + 2?\nA:", {"until": ["\n"]}), 0)
    with pytest.raises(NotImplementedError, match="does not generate"):
        lm.generate_until([request])


def test_the_prefix_and_max_length_follow_the_checkpoint(checkpoint, scorers):
    lm = TpuscoreLM(pretrained=str(checkpoint), dtype="float32")
    tokenizer = scorers("llama3_rope_tied").tokenizer
    assert lm.prefix_token_id == tokenizer.token_to_id(BOS)
    assert lm.eot_token_id == tokenizer.token_to_id(EOS)
    assert lm.max_length == lm.scorer.config.max_position_embeddings - 1
    with pytest.raises(ValueError, match="max_length"):
        TpuscoreLM(pretrained=str(checkpoint), max_length=lm.max_length + 1)


def test_a_classification_model_is_refused_when_made(checkpoint_dir):
    """A classifier has no token log-likelihoods: refused as the harness makes the model, not
    by the first request after the harness has built its tasks (as it was)."""
    with pytest.raises(ValueError, match="classification head"):
        TpuscoreLM(pretrained=str(checkpoint_dir("qwen3_seq_cls")), dtype="float32")


@pytest.mark.parametrize("backend, code", [("packed_dense", "unsupported_option"),
                                           ("fast", "unknown_backend")])  # fmt: skip
def test_a_backend_loglikelihood_cannot_run_on_is_refused_before_loading(tmp_path, backend, code):
    """Before the model loads (this path holds none), not at the first of many requests."""
    with pytest.raises(ValidationError) as refused:
        TpuscoreLM(pretrained=str(tmp_path / "no-model"), backend=backend)
    assert refused.value.code == code


def test_importing_tpuscore_does_not_import_lm_eval():
    code = "import sys, tpuscore; assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


def test_the_documented_command_runs_the_harness_cli(checkpoint, tmp_path, monkeypatch):
    """docs/lm_eval.md's command: the harness's CLI with "tpuscore" registered, run as
    `python -m` runs it (in this process: a subprocess would import the harness again)."""
    argv = [
        "tpuscore.integrations.lm_eval",
        "run",
        "--model",
        "tpuscore",
        "--model_args",
        f"pretrained={checkpoint},dtype=float32,max_length={MAX_LENGTH}",
        "--include_path",
        "tests/data/lm_eval",
        "--tasks",
        "tpuscore_mc",
        "--limit",
        "2",
        "--output_path",
        str(tmp_path),
    ]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", argv)
    # The CLI indexes the harness's thousands of built-in task files (~15 s here) besides
    # --include_path; this test needs only the local ones, as the `evaluated` fixture does.
    index = TaskManager.__init__
    monkeypatch.setattr(
        TaskManager,
        "__init__",
        lambda self, *a, **kw: index(self, *a, **kw | {"include_defaults": False}),
    )
    try:
        runpy.run_module("tpuscore.integrations.lm_eval", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        assert done.code in (None, 0), done.code
    (written,) = tmp_path.rglob("results_*.json")
    results = json.loads(written.read_text())["results"]["tpuscore_mc"]
    assert results["sample_len"] == 2
    assert 0.0 <= results["acc,none"] <= 1.0
