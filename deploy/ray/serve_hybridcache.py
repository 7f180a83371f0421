"""Run hybridcache on a Ray cluster: N engine replicas behind the checkpoint-aware request router.

    pip install 'hybridcache-llm[ray]'          # on every node (with the model folder at the same path)
    ray start --head                            # or join an existing cluster (ray start --address ...)
    python deploy/ray/serve_hybridcache.py --num-replicas 2 --num-gpus 1 -- MODEL --max-num-seqs 64
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 8}'

Everything after `--` is `hybridcache serve` options (the model first, engine sizes, --api-key, ...); every
replica runs with them. Without a running cluster, `ray.init()` starts a local one. The script stays in the
foreground until Ctrl-C, then shuts the application down. docs/server.md ("Several replicas with Ray Serve")
explains what runs where; `serve run` and Serve config files use `hybridcache.router.ray_serve:app_builder`
instead (config.yaml here).
"""

from __future__ import annotations

import argparse
import sys
import time

from hybridcache.extras import require_extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-replicas", type=int, default=2, help="engine replicas (default: %(default)s)")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica (0: CPU; default: %(default)s)")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica (default: %(default)s)")
    parser.add_argument("--routing", default="checkpoint", choices=["checkpoint", "kv-prefix", "round-robin"],
                        help="routing policy (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address of Ray Serve's HTTP proxy (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="its port (default: %(default)s)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `hybridcache serve` options")
    args = parser.parse_args(argv)
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args

    require_extra("ray", "deploy/ray/serve_hybridcache.py")
    import ray
    from ray import serve

    from hybridcache.router.policy import RoutingConfig
    from hybridcache.router.ray_serve import build_app

    ray.init()  # joins the cluster `ray start` made on this machine (or $RAY_ADDRESS's), else starts a local one
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(serve_args, num_replicas=args.num_replicas, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                    routing=RoutingConfig(args.routing))
    serve.run(app, name="hybridcache", route_prefix="/")
    print(f"hybridcache: {args.num_replicas} replicas serving the OpenAI API at http://{args.host}:{args.port}/v1 "
          "(Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete("hybridcache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
