"""A stand-in for `python -m sglang.launch_server` on machines without SGLang (tests only).

It takes SGLang's command line (the flags `flywheel.ops.engine_launch.sglang_command` emits, and
a few more a user passes in `engine.sglang_args`), refuses any other flag as SGLang's argparse
does (exit 2, "unrecognized arguments"), and serves the embedded engine with exactly what the
flags say: nothing comes from Flywheel's settings file (`FLYWHEEL_CONFIG` and
`FLYWHEEL_ENGINE__*` are dropped), so a flag `flywheel up` forgets is a flag the engine misses.
`--tp-size N` becomes the embedded engine's `emulate_tp_size` (it joins a weight-update group
as N ranks and reports `tp_size` N, computing on one device). SGLang's environment switches are
read as SGLang reads them: `SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN` (honoured by the
embedded engine) and `SGLANG_USE_CPU_ENGINE` (required with `--device cpu`). A grammar-constrained
token is reported with its logprob renormalised over the grammar's allowed tokens, as SGLang
0.5.23 reports it (`engine.grammar_logprobs = "renormalized"`).

Run: `python tests/sglang_standin.py --model-path DIR --port N ...`
(`engine.sglang_launcher = [python, "tests/sglang_standin.py"]`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from flywheel.core.weight_delta import ROUTE as DELTA_ROUTE

if TYPE_CHECKING:
    from fastapi import FastAPI

ENGINE_DTYPES = ("float32", "bfloat16")
"""SGLang's `--dtype` values the embedded engine serves."""

FLYWHEEL_ONLY_ROUTES = (DELTA_ROUTE,)
"""Routes of the embedded engine that SGLang has not."""


def without_flywheel_routes(app: FastAPI) -> FastAPI:
    """`app` (the embedded engine's FastAPI app) less `FLYWHEEL_ONLY_ROUTES`.

    Raises:
        RuntimeError: a route to drop is not there (renamed: the list must follow).
    """
    missing = set(FLYWHEEL_ONLY_ROUTES) - {getattr(r, "path", None) for r in app.router.routes}
    if missing:
        raise RuntimeError(f"sglang stand-in: the engine has no {sorted(missing)} to drop")
    app.router.routes = [
        r for r in app.router.routes if getattr(r, "path", None) not in FLYWHEEL_ONLY_ROUTES
    ]
    return app


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """SGLang's flags (names and types as in `sglang.srt.server_args`), a subset."""
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--context-length", type=int)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
    )
    p.add_argument("--random-seed", type=int)
    p.add_argument("--grammar-backend", default="xgrammar")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--device")
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--max-queued-requests", type=int)
    # Flags of SGLang's that only tune a GPU server: accepted, no effect on the stand-in.
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--log-level")
    p.add_argument("--tool-call-parser")
    p.add_argument("--reasoning-parser")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    print(f"sglang stand-in: {' '.join(sys.argv[1:] if argv is None else argv)}", flush=True)
    dtype = {"auto": "float32", "float": "float32"}.get(args.dtype, args.dtype)
    if dtype not in ENGINE_DTYPES:
        sys.exit(
            f"sglang stand-in: --dtype {args.dtype}: the embedded engine serves {ENGINE_DTYPES}"
        )
    if args.grammar_backend != "xgrammar":
        sys.exit(f"sglang stand-in: --grammar-backend {args.grammar_backend}: only xgrammar here")
    if args.device == "cpu" and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        sys.exit("sglang stand-in: --device cpu needs SGLANG_USE_CPU_ENGINE=1, as SGLang does")
    for key in [
        k for k in os.environ if k == "FLYWHEEL_CONFIG" or k.startswith("FLYWHEEL_ENGINE__")
    ]:
        del os.environ[key]
    engine = {
        "served_model_name": args.served_model_name or args.model_path,
        "context_length": args.context_length,
        "dtype": dtype,
        "seed": args.random_seed,
        "device": args.device,
        "max_batch_size": args.max_running_requests,
        "emulate_tp_size": args.tp_size,  # joins weight-update groups as that many ranks
        "grammar_logprobs": "renormalized",  # SGLang masks the logits before its log-softmax
    }
    for name, value in engine.items():
        if value is not None:
            os.environ[f"FLYWHEEL_ENGINE__{name.upper()}"] = str(value)
    import flywheel.engine.app as engine_app  # noqa: PLC0415
    from flywheel.engine.main import main as serve  # noqa: PLC0415

    build = engine_app.create_app
    engine_app.create_app = lambda deps: without_flywheel_routes(build(deps))

    serve(
        [
            "--model-path", args.model_path,
            "--host", args.host,
            "--port", str(args.port),
            "--weight-version", args.weight_version,
        ]
    )  # fmt: skip


if __name__ == "__main__":
    main()
