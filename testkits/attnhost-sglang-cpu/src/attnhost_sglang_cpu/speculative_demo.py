"""Speculative decoding in a real ``sglang.Engine`` on the CPU, with your attention backend as target and draft.

``python -m attnhost_sglang_cpu.speculative_demo --backend NAME`` builds a
tiny Llama and its draft locally (no model hub), asks HF transformers for the
greedy continuation of two prompts, then runs SGLang's own speculative worker
(``STANDALONE``) in a real engine, NAME as the target's and the draft's
attention backend: a chain (``topk`` 1) and, when NAME declares tree masks, a
tree (``topk`` 2). It prints each prompt's ids, HF's, whether they are equal,
and the acceptance (verify steps, tokens accepted per step), and which
backend class each model runner built, as attnhost's probe saw it. The exit
status is 0 when every run's ids equal HF's, 1 otherwise.

The CPU environment SGLang needs is set here, for the engine only, never in
the caller's shell: ``SGLANG_PLATFORM=attnhost_test_cpu`` (this kit's
platform), ``TRITON_INTERPRET=1`` (SGLang's speculative workers launch triton
kernels, which run on a CPU only in triton's interpreter),
``TORCHDYNAMO_DISABLE=1`` (its draft selection is ``torch.compile``d, which
would compile C++ for minutes), ``HF_HUB_OFFLINE=1`` /
``TRANSFORMERS_OFFLINE=1`` and no inherited ``SGLANG_*`` / ``ATTNHOST_*``
settings (docs/speculative-cpu.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from attnhost_sglang_cpu import SPECULATIVE_ENV
from attnhost_sglang_cpu.e2e import ids_mismatch, read_probe, run_engines, speculative_summary

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attnhost_sglang_cpu.speculative_demo",
        description="Speculative decoding in a real sglang.Engine on the CPU, NAME as target and draft backend.",
    )
    parser.add_argument(
        "--backend", required=True, help="the attnhost backend, target and draft: a draft-capable one (`attnhost list`)"
    )
    parser.add_argument(
        "--topk",
        default="1,2",
        help="the runs, by speculative_eagle_topk: 1 a chain, 2 a tree (default: 1,2; the tree only for a backend "
        "that declares tree masks)",
    )
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per prompt (default: 8)")
    parser.add_argument(
        "--draft",
        choices=("copy", "random"),
        default="copy",
        help="the draft model: a copy of the target (drafts accepted) or a random one-layer Llama (mostly rejected)",
    )
    parser.add_argument("--workdir", type=Path, help="where the models are built (default: a temporary directory)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for key in [k for k in os.environ if k.startswith(("SGLANG_", "ATTNHOST_"))]:
        del os.environ[key]  # as for the engine (sglang_env): no setting of the calling shell changes the run
    try:
        topks = sorted({int(t) for t in args.topk.split(",")})
    except ValueError:
        print(f"--topk {args.topk!r}: give 1, 2 or 1,2", file=sys.stderr)
        return 2
    if not topks or min(topks) < 1:
        print(f"--topk {args.topk!r}: give 1, 2 or 1,2", file=sys.stderr)
        return 2
    engine_name, tree_mask = _resolve(args.backend)
    if engine_name is None:
        return 2
    if not tree_mask and any(t > 1 for t in topks):
        print(f"backend {args.backend!r} does not declare tree masks (capabilities.tree_mask): chain only")
        topks = [t for t in topks if t == 1]
    if not topks:
        return 2
    if args.workdir is not None:
        return _run(args, engine_name, topks, args.workdir)
    with tempfile.TemporaryDirectory(prefix="attnhost-speculative-") as tmp:
        return _run(args, engine_name, topks, Path(tmp))


def _resolve(name: str) -> tuple[str | None, bool]:
    """The name SGLang knows attnhost backend *name* by, and whether it declares tree masks; ``None`` and a
    sentence on stderr when SGLang will not have it."""
    import warnings

    from attnhost_sglang_cpu import shim

    shim.install()
    with warnings.catch_warnings():  # SGLang's import-time notes on kernels a CPU lacks say nothing here
        warnings.simplefilter("ignore")
        from sglang.srt.plugins import load_plugins

        load_plugins()
    from attnhost.backend import capabilities_of
    from attnhost.engines.sglang.bridge import current_plan
    from attnhost.host import get_registry

    registry = get_registry()
    canonical = registry.canonical(name)
    if canonical is None:
        print(f"attnhost backend {name!r}: {registry.unknown_message(name)}", file=sys.stderr)
        return None, False
    plan = current_plan()
    exported = plan.engine_name(canonical) if plan is not None else None
    if exported is None:
        why = "; ".join(plan.skipped) if plan is not None else "attnhost's SGLang plugin did not run"
        print(f"backend {name!r} is not exported to SGLang ({why})", file=sys.stderr)
        return None, False
    entry = registry.entry(canonical)
    if not entry.draft:
        print(
            f"backend {name!r} is target-only (its plugin does not list it in attnhost_draft_attention_backends), so "
            "it cannot be the draft's backend; `attnhost list --draft` shows those that can",
            file=sys.stderr,
        )
        return None, False
    return exported, bool(capabilities_of(entry.spec.load()).tree_mask)


def _run(args: argparse.Namespace, engine_name: str, topks: list[int], workdir: Path) -> int:
    from transformers.utils import logging as hf_logging

    from attnhost_sglang_cpu import tiny_model as tm
    from attnhost_sglang_cpu.run_engine import speculative_args

    hf_logging.disable_progress_bar()  # building and reading a tiny model needs no progress bars on the screen
    target, draft = workdir / "target", workdir / "draft"
    tm.build_model(target)
    tm.build_draft_model(draft, target, copy_of_target=args.draft == "copy")
    prompts = tm.prompt_ids(target)
    hf_ids = tm.hf_greedy(target, prompts, args.new_tokens)
    print(
        f"backend {args.backend!r} (SGLang name {engine_name!r}) as target and draft; target: tiny Llama at "
        f"{target}; draft: {'a copy of the target' if args.draft == 'copy' else 'a random one-layer Llama'} at {draft}"
    )
    runs: list[dict[str, Any]] = [
        {
            "name": f"topk{topk}",
            "backend": engine_name,
            "engine_args": speculative_args(str(draft), topk=topk, draft_backend=engine_name),
        }
        for topk in topks
    ]
    done = run_engines(target, prompts, args.new_tokens, runs, workdir, env=SPECULATIVE_ENV)
    failures = 0
    for topk in topks:
        kind = f"{'chain' if topk == 1 else 'tree'} (STANDALONE, topk {topk}, 3 steps, 4 draft tokens)"
        result = done.results[f"topk{topk}"]
        print(f"\n{kind}:")
        if "error" in result:
            failures += 1
            print(f"  sglang.Engine failed:\n{result['error']}")
            continue
        for i, (ids, meta) in enumerate(zip(result["output_ids"], result["meta_info"], strict=True)):
            print(f"  prompt {i}: engine {ids}")
            print(f"            HF     {hf_ids[i]}")
            print(f"            equal: {'yes' if ids == hf_ids[i] else 'no'}; {_acceptance(meta)}")
        seen = speculative_summary(read_probe(done.probes[f"topk{topk}"]))
        for role in ("target", "draft"):
            classes = ", ".join(c.rpartition(".")[2] for c in seen[f"{role}_class"]) or "?"
            print(f"  {role} runner: {classes}, forward modes {', '.join(sorted(seen['modes'][role])) or '?'}")
        problem = ids_mismatch(args.backend, kind, result["output_ids"], hf_ids)
        if problem is not None:
            failures += 1
            print(f"  {problem}")
    verdict = "yes" if not failures else f"no ({failures} run(s) differ or failed)"
    print(f"\nspeculative greedy ids equal HF transformers': {verdict}")
    return 0 if not failures else 1


def _acceptance(meta: dict[str, Any]) -> str:
    """SGLang's speculative counters for one prompt: its verify steps, the tokens each gave (``spec_accept_length``,
    the bonus token included) and the share of draft tokens the target accepted (``spec_accept_rate``)."""
    verify, length, rate = meta.get("spec_verify_ct", 0), meta.get("spec_accept_length"), meta.get("spec_accept_rate")
    text = f"verify steps {verify}"
    if isinstance(length, float | int):
        text += f", tokens per verify step {length:.2f}"
    if isinstance(rate, float | int):
        text += f", draft tokens accepted {rate:.0%}"
    return text


if __name__ == "__main__":
    sys.exit(main())
