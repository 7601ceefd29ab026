"""peft-built LoRA adapters and their scores by transformers + peft: the oracle of the adapter
tests (test_lora.py for the decoder, test_lora_scorer.py for the scorer, backends and server)."""

from __future__ import annotations

import peft
import torch

from hf_reference import model_logprobs

# name -> peft LoraConfig kwargs: different ranks, alphas, scalings and targets.
ADAPTERS = {
    "attn_mlp": {"r": 3, "lora_alpha": 5, "target_modules": ["q_proj", "down_proj"]},
    "rslora": {
        "r": 5,
        "lora_alpha": 7,
        "use_rslora": True,
        "target_modules": ["k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"],
    },
    "all_one_layer": {
        "r": 2,
        "lora_alpha": 2,
        "layers_to_transform": [1],
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],  # fmt: skip
    },
}
TOLERANCE = 1e-4


def fresh_hf(base, classifier=False):
    """A new transformers model (peft wraps it in place, so never the cached reference one)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    return auto.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()


def save_adapter(base, out, seed, classifier=False, **kwargs):
    """A peft LoRA adapter with random A and B (init_lora_weights=False), saved to out."""
    torch.manual_seed(seed)
    task = {"task_type": "SEQ_CLS"} if classifier else {}
    model = peft.get_peft_model(
        fresh_hf(base, classifier),
        peft.LoraConfig(init_lora_weights=False, **task, **kwargs),
    )
    with torch.no_grad():  # peft's random B is small; make each adapter move the scores clearly
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
    model.save_pretrained(out)
    return out


def peft_logprobs(base, adapter_path, seqs, labels, merged):
    model = peft.PeftModel.from_pretrained(fresh_hf(base), adapter_path).eval()
    if merged:
        model = model.merge_and_unload()
    return model_logprobs(model, seqs, labels)
