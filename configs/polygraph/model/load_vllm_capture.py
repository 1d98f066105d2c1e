"""polygraph_eval load script: a capturing vllm.LLM plus SamplingParams (model.type: vLLMCausalLM).

polygraph_eval calls ``load_model(model_path=..., max_new_tokens=..., logprobs=..., **load_model_args)``.
"""

from uhead_vllm.polygraph.loading import load_capture_llm


def load_model(model_path, max_new_tokens, logprobs, **load_model_args):
    return load_capture_llm(model_path, max_new_tokens, logprobs, **load_model_args)
