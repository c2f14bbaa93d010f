"""The `specdec` command: `specdec generate "prompt"` streams a completion; `specdec serve` runs the
three services locally."""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time

DEFAULT_ADDR = "127.0.0.1:50050"
INT32_MAX = 2 ** 31 - 1


def _int_in(low: int, high: int):
    """An argparse type: an integer in low..high (the request field's range)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} outside {low}..{high}")
        return value
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _address(text: str) -> str:
    """An argparse type: a gRPC target whose port, where it names one, is in 1..65535 (gRPC wraps
    a larger one around to another port)."""
    if text.startswith("unix:") or text.endswith("]"):
        return text
    _, sep, port = text.rpartition(":")
    if sep and port and (not port.isdigit() or not 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"the port must be a number in 1..65535, got {text!r}")
    return text


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from coordinator.client import Client

    params = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop or (),
                  ignore_eos=args.ignore_eos, num_draft=args.num_draft,
                  speculate=False if args.no_spec else None)
    tokens, last = 0, None
    t0 = time.perf_counter()
    first = None
    with Client(args.addr) as client:
        stream = client.generate(args.prompt, timeout=args.timeout, **params)
        try:
            for chunk in stream:
                if first is None:
                    first = time.perf_counter()
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                tokens += len(chunk.token_ids)
                last = chunk
        except grpc.RpcError as e:
            print(f"\nspecdec: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nspecdec: cancelled", file=sys.stderr)
            return 130
        except (ValueError, TypeError) as e:   # a value the request cannot hold
            print(f"specdec: {e}", file=sys.stderr)
            return 2
        except BrokenPipeError:   # the reader went away (`| head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        finally:
            stream.close()   # cancels the call if it has not ended
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    usage = last.usage if last else None
    ratio = usage.acceptance_ratio if usage else None
    accepted = f"{ratio:.2f}" if ratio is not None else "-"
    tau = f"{1 + usage.accepted_tokens / usage.steps:.2f}" if usage and usage.steps else "-"
    ttft = f"{(first - t0) * 1000:.0f}ms" if first else "-"
    print(f"[{tokens} tokens, finish={last.finish_reason if last else '-'}, accepted/drafted={accepted}, "
          f"tau={tau}, {tokens / elapsed:.1f} tok/s, ttft={ttft}]", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from coordinator import launch
    from coordinator.launch import LaunchError, local_cluster

    launch.DIE_WITH_PARENT = True   # a SIGKILLed serve leaves no children (launch.py)
    def terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    coordinator_args = ["--num-draft", str(args.num_draft), "--max-batch-size", str(args.max_batch_size),
                        "--gamma", args.gamma]
    try:
        with local_cluster(args.target, args.draft, device=args.device, draft_device=args.draft_device,
                           coordinator_port=args.port, log_dir=args.log_dir,
                           coordinator_args=coordinator_args,
                           server_args=args.server_arg or ()) as cluster:
            print(f"specdec: target {cluster.target}, draft {cluster.draft or '-'}; coordinator ready at "
                  f"{cluster.coordinator} (logs in {cluster.log_dir}); Ctrl-C stops all", file=sys.stderr)
            print("specdec: Prometheus /metrics at " + ", ".join(
                f"{role} {address}" for role, address in sorted(cluster.metrics.items())), file=sys.stderr)
            while all(p.popen.poll() is None for p in cluster.procs.values()):
                time.sleep(0.5)
            dead = [p for p in cluster.procs.values() if p.popen.poll() is not None]
            for p in dead:
                print(f"specdec: {p.name} exited with code {p.popen.returncode}:\n{p.log_tail()}",
                      file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("specdec: stopping", file=sys.stderr)
        return 0
    except LaunchError as e:
        print(f"specdec: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion from a running coordinator")
    g.add_argument("prompt")
    g.add_argument("--addr", type=_address, default=DEFAULT_ADDR, help=f"coordinator address (default {DEFAULT_ADDR})")
    g.add_argument("--max-new-tokens", type=_int_in(1, INT32_MAX), default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=_int_in(0, INT32_MAX), default=0)
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=_int_in(0, 2 ** 64 - 1), default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--num-draft", type=_int_in(0, INT32_MAX), default=0,
                   help="draft tokens per step (0: server's choice)")
    g.add_argument("--no-spec", action="store_true", help="plain decoding (no draft)")
    g.add_argument("--timeout", type=_seconds, default=None, help="deadline in seconds")
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="run target server, draft server and coordinator locally")
    s.add_argument("--target", required=True, help="target model folder")
    s.add_argument("--draft", default=None, help="draft model folder (omit: no speculation)")
    s.add_argument("--device", default="cpu", help="device of the target (and of the draft by default)")
    s.add_argument("--draft-device", default=None)
    s.add_argument("--port", type=int, default=int(DEFAULT_ADDR.rsplit(":", 1)[1]))
    s.add_argument("--num-draft", type=int, default=4)
    s.add_argument("--max-batch-size", type=int, default=32)
    s.add_argument("--gamma", choices=("fixed", "auto"), default="fixed")
    s.add_argument("--log-dir", default=None, help="where the three logs go (default: a temp folder)")
    s.add_argument("--server-arg", action="append", help="extra argument for both model servers")
    s.set_defaults(func=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
