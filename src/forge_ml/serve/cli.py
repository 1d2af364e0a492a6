"""``forge-ml serve``: serve a checkpoint with OpenAI's completions API.

``add_parser(subparsers)`` adds the subcommand to ``forge-ml``'s parser and ``run(args)``
runs it; ``python -m forge_ml.serve.cli ...`` runs it alone. The server listens on
127.0.0.1 unless ``--host`` says otherwise; ``--api-key`` (or the environment variable
``FORGE_API_KEY``) makes every request carry ``Authorization: Bearer KEY``. An empty key is
refused, not taken as none: ``--api-key ''``, or ``FORGE_API_KEY`` set but empty or blank
(``"$KEY"`` with KEY unset); only an unset ``FORGE_API_KEY`` and no ``--api-key`` serve
without one.

>>> import argparse
>>> sub = argparse.ArgumentParser().add_subparsers()
>>> args = add_parser(sub).parse_args(["--ckpt", "runs/default"])
>>> args.host, args.port, args.device, args.dtype
('127.0.0.1', 8000, 'cpu', 'float32')
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import signal
import sys
from pathlib import Path

from .. import flags
from ..errors import ConfigError

EPILOG = """examples:
  forge-ml serve --ckpt runs/default
  forge-ml serve --ckpt ~/gpt2 --device cuda --dtype bf16 --host 0.0.0.0 --api-key $KEY
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "Hello", "max_tokens": 20, "stream": true}'
  OpenAI's client: openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY or "-")
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns it."""
    from ..cli import _fmt   # the other subcommands' layout: the description filled, examples as written
    p = subparsers.add_parser(
        "serve", help="serve a checkpoint over HTTP with OpenAI's completions API",
        formatter_class=_fmt(),
        description="Serve a forge-ml checkpoint, a run folder, or a Hugging Face GPT-2 folder "
                    "over HTTP, compatible with OpenAI's API (GET /v1/models[/MODEL], GET /health, POST "
                    "/v1/completions, streaming by server-sent events). Concurrent requests "
                    "share the decode steps (continuous batching). Needs the serve extra: "
                    "pip install 'forge-ml[serve]'.",
        epilog=EPILOG)
    add_arguments(p)
    return p



def model_id(ckpt) -> str:
    """The model id a server of ``ckpt`` answers to: the folder's name, or the run's for a
    run's ``ckpt`` or ``best`` folder (beside the run's ``log.jsonl``: clients ask for
    ``my-run``, not ``ckpt``).

    >>> model_id("runs/my-run"), model_id("~/gpt2")
    ('my-run', 'gpt2')
    """
    where = Path(ckpt).expanduser().resolve()
    if where.name in ("ckpt", "best") and (where.parent / "log.jsonl").is_file():
        where = where.parent
    return where.name or "default"

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="checkpoint folder, run folder or HF GPT-2 folder")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bf16", "bfloat16"],
                   help="float32, or bf16 weights on the GPU (default float32)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $FORGE_API_KEY, else none; "
                        "an empty key, given or in FORGE_API_KEY, is refused)")
    p.add_argument("--slots", type=int, default=None, metavar="N",
                   help="requests decoded together (default 64 on cuda, 8 on cpu)")
    p.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="context per request, prompt and new tokens (default: the model's)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients ask for (default: the checkpoint folder's name; a run's for RUN/ckpt)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, seconds the requests in flight get to finish "
                        "before they are cut (new connections are refused at once; default 5)")


def _load(ckpt: str, device: str, dtype: str):
    from ..inference.load import check_tokenizer_fits, load_model
    model, tok, meta = load_model(ckpt, device=device, dtype=dtype)
    check_tokenizer_fits(model, tok, ckpt)
    return model, tok, meta


def run(args) -> int:
    """Load the checkpoint, start the engine, serve until interrupted; returns 0."""
    try:
        import uvicorn

        from .app import BatchEngine, create_app
    except ImportError as e:
        raise ConfigError(f"forge-ml serve needs the serve extra ({e.name} is missing): "
                          "pip install 'forge-ml[serve]'") from None
    dtype = "bfloat16" if args.dtype in ("bf16", "bfloat16") else "float32"
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ConfigError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    if args.slots is not None and args.slots < 1:
        raise ConfigError(f"--slots must be >= 1 (requests decoded together), got {args.slots}")
    if args.api_key is not None and not args.api_key.strip():
        # `--api-key "$KEY"` with KEY unset: the server would take every request, in silence
        raise ConfigError("--api-key is empty; give the key clients must send (or leave the "
                          "option out to serve without one)")
    if args.model_name is not None and not args.model_name.strip():
        # (it was taken as "not given": the folder's name served, in silence)
        raise ConfigError("--model-name is empty; give the id clients ask for (or leave the "
                          "option out for the checkpoint folder's name)")
    api_key = args.api_key or flags.get("FORGE_API_KEY") or None
    if api_key is None and flags.given("FORGE_API_KEY"):   # (get: "" for unset and empty alike)
        # `export FORGE_API_KEY=$KEY` with KEY unset: the same silence as `--api-key ""`
        raise ConfigError("FORGE_API_KEY is set but empty; expected the key clients must send "
                          "(unset the variable to serve without one)")
    with contextlib.ExitStack() as held:   # the sockets close however this ends
        socks = _listen_sockets(args.host, args.port)   # before the model loads: a busy port fails fast
        for sock in socks:
            held.enter_context(sock)
        model, tokenizer, _ = _load(args.ckpt, args.device, dtype)
        if args.max_len is not None and not 1 <= args.max_len <= model.config.block_size:
            raise ConfigError(f"--max-len must be in 1..{model.config.block_size} (the model's "
                              f"context), got {args.max_len}")
        engine = BatchEngine(model, tokenizer, slots=args.slots, max_len=args.max_len)
        name = args.model_name or model_id(args.ckpt)
        app = create_app(engine, name, api_key=api_key)
        if api_key is None and not _loopback(args.host):
            print(f"forge-ml serve: warning: listening on {args.host or 'every interface'} without an "
                  "API key; anyone who reaches this port can use the model (set --api-key or "
                  "FORGE_API_KEY)", file=sys.stderr)
        port = socks[0].getsockname()[1]   # --port 0: the one the system chose
        print(f"forge-ml serve: model {name!r} ({model.num_params():,} parameters, {model.device}, "
              f"{dtype}), {engine.slots} slots, context {engine.max_len}; "
              f"http://{_address(args.host, port)}/v1", file=sys.stderr, flush=True)
        try:
            _Server(uvicorn.Config(app, host=args.host, port=port, log_level="info",
                                   timeout_graceful_shutdown=args.shutdown_timeout),
                    engine).run(sockets=socks)
        except SystemExit as e:   # uvicorn exits on an error of its own; it has said why
            return e.code if isinstance(e.code, int) else 1
        finally:
            engine.close()
        return 0


def _address(host: str, port: int) -> str:
    """``host:port`` as a URL and an error name it: an IPv6 address in brackets, "" (every
    interface) as 0.0.0.0.

    >>> _address("::1", 8000), _address("", 80)
    ('[::1]:8000', '0.0.0.0:80')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"


def _listen_sockets(host: str, port: int) -> list:
    """Listening TCP sockets for ``host``:``port``, one an address the name resolves to (all
    interfaces for "", as asyncio has it), uvicorn's to serve; or a one-line ConfigError that
    says why not (a port in use, an address this machine does not have), where uvicorn
    announced the address, then printed its error among six lines of log. They listen at
    once, so a second server on the port fails here, not after this one's model has loaded.

    >>> socks = _listen_sockets("127.0.0.1", 0); socks[0].getsockname()[1] > 0
    True
    >>> for s in socks: s.close()
    """
    import socket

    where = _address(host, port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"--host {host}: not an address of this machine ({why})") from None
    socks, seen, missing = [], set(), None
    try:
        for family, _, _, _, addr in infos:
            if (family, addr[0]) in seen:
                continue
            seen.add((family, addr[0]))
            if socks:   # --port 0: every address on the port the first one got
                addr = (addr[0], socks[0].getsockname()[1]) + tuple(addr[2:])
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError as e:   # a family this machine lacks (IPv6 switched off)
                missing = missing or e
                continue
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn's own bind
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)   # as asyncio's
            try:
                sock.bind(addr)
            except OSError as e:
                if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    raise
                socks.pop().close()   # an address this machine lacks: skipped, as asyncio does
                missing = missing or e
                continue
            sock.listen(2048)
        if not socks:
            raise missing or OSError(errno.EADDRNOTAVAIL, "no address to listen on")
    except OSError as e:
        for sock in socks:
            sock.close()
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            why = f"port {port} is in use (another server? choose another with --port)"
        raise ConfigError(f"cannot listen on {where}: {why}") from None
    return socks


class _Server:
    """uvicorn's server, which on SIGTERM or Ctrl-C also ends the requests still running a
    moment before its own grace period does (``engine.close``): each gets OpenAI's error body
    (a 503, or an error event and ``[DONE]`` in a stream) where uvicorn's cut gave a plain-text
    500, a truncated stream and a traceback a request. A second Ctrl-C (uvicorn's "quit now")
    ends them so at once, and uvicorn's forced exit follows a second later for connections
    that are still open (a client that does not read); a second SIGTERM changes nothing, as in
    uvicorn (a supervisor may send it twice)."""

    def __new__(cls, config, engine):
        import threading

        import uvicorn

        def later(seconds, fn, *args, **kwargs):
            timer = threading.Timer(seconds, fn, args, kwargs)
            timer.daemon = True
            timer.start()

        class Server(uvicorn.Server):
            forcing = False

            def handle_exit(self, sig, frame):
                if not self.should_exit:
                    grace = config.timeout_graceful_shutdown or 0.0
                    later(max(0.0, grace - min(1.0, grace / 2)), engine.close,
                          reason="the server is shutting down; this request was cut before it finished")
                elif sig == signal.SIGINT and not self.forcing:   # as uvicorn: SIGINT only
                    # the requests' error bodies first (the engine's loop is not waited for: this
                    # runs on the event loop that sends them), then uvicorn's force_exit
                    self.forcing = True
                    engine.close(timeout=0, reason="the server was stopped at once (a second "
                                                   "signal); this request was cut before it finished")
                    later(1.0, super().handle_exit, sig, frame)
                    return
                super().handle_exit(sig, frame)

        return Server(config)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv=None) -> int:
    """``python -m forge_ml.serve.cli ARGS``: the subcommand on its own."""
    from ..errors import ForgeError

    p = argparse.ArgumentParser(prog="forge-ml serve", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ForgeError as e:
        print(f"forge-ml serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
