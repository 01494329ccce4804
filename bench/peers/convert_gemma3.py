"""Convert Gemma 3 270M (the Q4_K_M GGUF `pdserve up --model gemma3-270m` serves) into a plain
Hugging Face folder (safetensors, tokenizer), for the side-by-side with vLLM-CPU: both servers then
serve this one folder.

The file is the pretrained model, with no chat template. The benchmark's workload is chat with a
fixed output length (`ignore_eos`), so the folder gets Gemma's turn format as its template
(`<start_of_turn>user ... <end_of_turn>`), the same text for both servers. The weights are the
GGUF's, dequantized by transformers' GGUF loader, in bf16. The Gemma terms apply to the result.

Usage (the project's .venv): python bench/peers/convert_gemma3.py [OUT_DIR]
Default OUT_DIR: PEER_DIR/gemma3-270m-hf.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pdserve.engine.model.path import resolve_model  # noqa: E402

PEER_DIR = os.environ.get("PEER_DIR", os.path.expanduser("~/.cache/pdserve-peers"))
TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.path.join(PEER_DIR, "gemma3-270m-hf"))
    out = Path(ap.parse_args().out)
    gguf = resolve_model("gemma3-270m")
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The GGUF loader marks the model quantized (not serializable) though its weights are dense
    # now: a plain Gemma 3 from the config without that mark, with the weights copied in.
    cfg = loaded.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version", "dtype"):
        cfg.pop(k, None)
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    config = Gemma3TextConfig.from_dict(cfg)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.chat_template = TURNS
    tok.save_pretrained(out)
    print(f"wrote {out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
