"""`kvrelay generate`: run the model in this process and print the generated tokens.

    kvrelay generate --model gpt-oss-tiny --dummy --prompt "Hello" --max-new-tokens 16 --json
    kvrelay generate --model tests/data/gpt-oss-tiny-original --prompt-ids 1,2,3 --greedy
    kvrelay generate --model tiny --dummy --prompt-ids 1,2,3 --tp 2          # 2 CPU ranks over gloo

--prompt renders one harmony user turn (openai-harmony, offline vocabulary: engine/vocab.py)
and stops on <|return|> / <|call|>; --prompt-ids feeds raw ids and stops only on --max-new-tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvrelay.engine.config import MODEL_QUANTS

# <|return|> and <|call|>: the assistant's turn-ending tokens in the harmony format.
HARMONY_STOP_IDS = (200002, 200012)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name (gpt-oss-20b, tiny, ...) or model directory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="text, rendered as a harmony user turn")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    mode.add_argument("--temperature", type=float, help="sample at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible runs)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--quant", choices=MODEL_QUANTS, default="bf16")
    parser.add_argument("--dummy", action="store_true", help="random weights of the model's shape")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of the --dummy weights")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks: spawns this many CPU processes joined by gloo (debugging)")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel ranks: --tp (default; each rank holds whole experts) or 1 "
                             "(each rank holds a slice of every expert)")


def _harmony():
    """The gpt-oss encoding; RuntimeError (one line naming the fix) when the vocabulary cannot be used."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    from kvrelay.engine import vocab

    path = vocab.export()  # VocabularyError, a RuntimeError, says what to fix
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # the library raises its own HarmonyError type
        raise RuntimeError(f"openai-harmony could not load the o200k vocabulary {path}: {e}") from e


def _render_user_turn(encoding, text: str) -> list[int]:
    from openai_harmony import Conversation, Message, Role

    conv = Conversation.from_messages([Message.from_role_and_content(Role.USER, text)])
    return list(encoding.render_conversation_for_completion(conv, Role.ASSISTANT))


def _parse_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def _load_and_generate(shard, args: argparse.Namespace, prompt_ids: list[int], params) -> dict:
    """Load the model (this rank's shard of it) and generate; runs in each rank's process under --tp."""
    from kvrelay.engine.llm import LLM
    from kvrelay.engine.parallel import held_tensor_bytes

    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, quant=args.quant, dummy=args.dummy, seed=args.weights_seed,
              shard=shard)
    t1 = time.perf_counter()
    outs = list(llm.generate(prompt_ids, params))
    t2 = time.perf_counter()
    return {"outs": outs, "load_s": t1 - t0, "generate_s": t2 - t1,
            "weight_bytes": held_tensor_bytes(llm.runner.model)}


def _generate(args: argparse.Namespace, cfg, prompt_ids: list[int], params) -> list[dict]:
    """One result per rank. With --tp N the ranks run the same request in lockstep; the sampling seed is
    fixed here, before spawning, so every rank draws the same token from the same gathered logits."""
    from kvrelay.engine.parallel import SINGLE, run_ranks
    from kvrelay.engine.partition import check_partition

    ep = args.tp if args.ep is None else args.ep
    if args.tp < 1 or ep not in (1, args.tp):
        raise ValueError(f"--tp must be >= 1 and --ep either 1 or --tp ({args.tp}); got --tp {args.tp} --ep {ep}")
    if args.tp == 1:
        return [_load_and_generate(SINGLE, args, prompt_ids, params)]
    if args.device != "cpu":
        raise ValueError("--tp > 1 spawns CPU ranks over gloo; serve GPU tensor parallelism with `kvrelay serve`")
    check_partition(cfg, args.tp, expert_parallel=ep == args.tp)  # fail now, not in N processes
    ranks = run_ranks(_load_and_generate, args.tp, args, prompt_ids, params.resolved(), timeout_s=3600,
                      expert_parallel=ep == args.tp)
    tokens = [[o.token_id for o in r["outs"]] for r in ranks]
    if any(t != tokens[0] for t in tokens):
        raise RuntimeError(f"tensor-parallel ranks generated different tokens: {tokens}")
    return ranks


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.engine.config import load_model_config
    from kvrelay.engine.sampling import SamplingParams

    def fail(msg: str) -> int:
        print(f"kvrelay generate: error: {msg}", file=sys.stderr)
        return 2

    try:
        cfg = load_model_config(args.model)
        encoding, stop_ids = None, ()
        if args.prompt is not None:
            encoding = _harmony()
            prompt_ids = _render_user_turn(encoding, args.prompt)
            stop_ids = HARMONY_STOP_IDS
            if max(prompt_ids) >= cfg.vocab_size:
                return fail(f"--prompt renders harmony ids up to {max(prompt_ids)} but {cfg.name} has a vocabulary "
                            f"of {cfg.vocab_size}; use --prompt-ids (or a full-vocabulary model)")
        else:
            prompt_ids = _parse_ids(args.prompt_ids)
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            return fail("--device cuda but no CUDA device is available")
        params = SamplingParams(
            max_tokens=args.max_new_tokens,
            temperature=0.0 if args.temperature is None else args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop_token_ids=stop_ids, logprobs=True,
        )
        ranks = _generate(args, cfg, prompt_ids, params)
    except (ValueError, FileNotFoundError, RuntimeError, KeyError) as e:
        return fail(str(e))
    except Exception as e:  # weights.WeightError and friends: report, don't dump a traceback
        if type(e).__name__.endswith("Error"):
            return fail(f"{type(e).__name__}: {e}")
        raise

    outs = ranks[0]["outs"]
    load_s, generate_s = max(r["load_s"] for r in ranks), max(r["generate_s"] for r in ranks)
    token_ids = [o.token_id for o in outs]
    text = None
    if encoding is None and cfg.vocab_size > max(HARMONY_STOP_IDS) and args.prompt_ids is not None:
        try:
            encoding = _harmony()
        except RuntimeError:
            encoding = None  # raw ids in, raw ids out: text is optional here
    if encoding is not None and all(t < cfg.vocab_size for t in token_ids):
        try:
            text = encoding.decode(token_ids)
        except Exception:
            text = None  # reserved ids (dummy weights emit them) have no text
    result = {
        "model": cfg.name,
        "prompt_ids": prompt_ids,
        "token_ids": token_ids,
        "text": text if text is not None else " ".join(map(str, token_ids)),
        "text_is_ids": text is None,
        "finish_reason": outs[-1].finish_reason if outs else None,
        "logprobs": [o.logprob for o in outs],
        "load_s": round(load_s, 3),
        "generate_s": round(generate_s, 3),
        "tokens_per_s": round(len(outs) / max(generate_s, 1e-9), 2),
        "tp": args.tp,
        "ep": args.tp if args.ep is None else args.ep,
        "weight_bytes_per_rank": [r["weight_bytes"] for r in ranks],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        mib = ", ".join(f"{b / 2**20:.1f}" for b in result["weight_bytes_per_rank"])
        print(f"[{len(token_ids)} tokens, finish={result['finish_reason']}, {result['tokens_per_s']} tok/s, "
              f"TP{args.tp} weights per rank {mib} MiB]", file=sys.stderr)
    return 0
