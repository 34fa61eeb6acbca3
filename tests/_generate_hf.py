"""Load an exported student with transformers alone (no kdexp import) and generate; prints one JSON line.

    python _generate_hf.py STUDENT_HF_DIR

What it shows: AutoTokenizer encodes a prompt (the chat template's, when the export has one) to ids that decode back;
greedy generation runs from the exported generation_config; and generation stops at the exported eos id. The tiny
student is untrained, so it has no reason to emit eos by itself: a logits processor makes eos the only choice at the
third new token, and the run must end right there (a generation config without that eos id would go on to
max_new_tokens). It proves the export's ids stop `generate`, not that the model learned to end its text.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

STOP_AT = 3  # the new token that is forced to eos


class ForceAt(LogitsProcessor):
    def __init__(self, start: int, token: int):
        self.start, self.token = start, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.start == STOP_AT - 1:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0.0
        return scores


path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
gen = model.generation_config
eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
if tok.chat_template:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False,
                                     add_generation_prompt=True)
else:
    prompt = "The history of the"
ids = tok(prompt, return_tensors="pt").input_ids
n = ids.shape[1]
free = model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, n:].tolist()
stopped = model.generate(ids, do_sample=False, max_new_tokens=8,
                         logits_processor=LogitsProcessorList([ForceAt(n, tok.eos_token_id)]))[0, n:].tolist()
print(json.dumps({"kdexp_imported": any(m == "kdexp" or m.startswith("kdexp.") for m in sys.modules),
                  "prompt": prompt, "prompt_ids": ids[0].tolist(), "decoded": tok.decode(ids[0]),
                  "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
                  "generation_eos": eos, "generation_pad": gen.pad_token_id, "generation_bos": gen.bos_token_id,
                  "chat_template": bool(tok.chat_template), "free": free, "stopped": stopped,
                  "stop_at": STOP_AT}))
