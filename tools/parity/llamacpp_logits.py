"""llama.cpp's own logits on the prompts of a reference file, in the reference file format.

    /path/to/llamacpp-venv/bin/python -m tools.parity.llamacpp_logits --model X.gguf \\
        --token-ids-from f32-ref.npz --out llamacpp.npz

So llama.cpp is measured exactly like ferrox's modes: `tools/parity/compare_logits.py` makes
and saves a float32 reference (`--reference float32 --save-reference F --save-only`), this
tool runs llama-cpp-python on the *same token ids* (no second tokenizer, no second chat
template) with `logits_all=True` and writes llama.cpp's logits at every prompt position
and its greedy continuation (as long as the reference's), and `compare_logits.py
--reference-file F --ours-file llamacpp.npz` computes KL, top-1 and greedy match.

It runs in llama-cpp-python's own virtual environment (not a project dependency): it
imports only numpy, llama_cpp and models.reference (numpy only). The greedy
continuation is llama.cpp's argmax over its own logits, one token per eval, ignoring EOS
as compare_logits does.

`--extra-bufts off` (the default) builds the model with `use_extra_bufts = False`, the
setting the served peer needs on an Intel host with AMX (docs/benchmarks.md, "Start the
peer"), so the logits measured are those of the kernels the peer serves with.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from models.reference import PromptReference, load_reference, save_reference


def open_llama(model: str, n_ctx: int, threads: int, extra_bufts: bool):
    """llama_cpp.Llama with every position's logits kept (`logits_all`)."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    if not extra_bufts:
        default = lib.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        lib.llama_model_default_params = params  # Llama() reads it at construction
    return llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                           n_threads=threads, n_threads_batch=threads, verbose=False)


def llama_prompt(llm, token_ids: list[int], greedy_tokens: int, text: str | None) -> PromptReference:
    """llama.cpp's logits f32[n, V] after each prompt token and its greedy continuation."""
    llm.reset()
    llm.eval(list(token_ids))
    n = len(token_ids)
    logits = np.array(llm.scores[:n], dtype=np.float32)
    greedy: list[int] = []
    for _ in range(greedy_tokens):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        if len(greedy) < greedy_tokens:
            llm.eval([nxt])
    return PromptReference(token_ids=list(token_ids), text=text, logits=logits, greedy_ids=greedy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.parity.llamacpp_logits", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the .gguf file llama.cpp loads")
    p.add_argument("--token-ids-from", required=True, metavar="F",
                   help="a reference file (models/reference.py format): its prompts' token ids, "
                        "texts and greedy lengths are used")
    p.add_argument("--out", required=True, metavar="F", help="where llama.cpp's logits go (.npz or .json)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--extra-bufts", choices=["on", "off"], default="off",
                   help="llama.cpp's extra buffer types (AMX repacking); off: as the peer is served here")
    args = p.parse_args(argv)
    refs = load_reference(args.token_ids_from)
    n_ctx = max(len(r.token_ids) + len(r.greedy_ids or ()) for r in refs) + 8
    t0 = time.perf_counter()
    llm = open_llama(args.model, n_ctx, args.threads, args.extra_bufts == "on")
    out = [llama_prompt(llm, r.token_ids, len(r.greedy_ids or ()), r.text) for r in refs]
    save_reference(args.out, out)
    print(f"wrote llama.cpp's logits of {len(out)} prompts to {args.out} ({time.perf_counter() - t0:.1f} s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
