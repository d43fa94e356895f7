"""``tessera webhook serve|certs|manifest``: argparse wiring of the admission webhook."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Final

import structlog
import yaml

from api.hami.config import DeviceConfig, load_config_file
from api.kube.client import KubeClient
from scheduler_plugins.webhook.certs import (
    DEFAULT_HOSTS,
    ServingPki,
    ca_bundle,
    default_cert_dir,
    ensure_serving_pki,
)
from scheduler_plugins.webhook.errors import WebhookSetupError
from scheduler_plugins.webhook.manifest import (
    DEFAULT_NAME,
    MUTATE_PATH,
    service_target,
    url_target,
    webhook_configuration,
)
from scheduler_plugins.webhook.rules import HOST_ONLY_EXCLUDE, TESSERA_SCHEDULER, Settings

log = structlog.get_logger("tessera.webhook")

IN_CLUSTER = "in-cluster"
USER_AGENT: Final = "tessera-webhook"  # how the apiserver's audit log names this client


_NAMESPACE_RE: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _namespace(text: str) -> str:
    """A namespace name (an RFC 1123 label), else argparse's error naming it."""
    if len(text) > 63 or not _NAMESPACE_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name (lowercase letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63 characters)"
        )
    return text


def add_webhook_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``webhook`` with its sub-commands on an ``add_subparsers()`` object."""
    webhook = subparsers.add_parser(
        "webhook",
        help="mutating admission webhook for pods (schedulerName, defaults, guards)",
    )
    sub = webhook.add_subparsers(dest="webhook_command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="serve AdmissionReviews over HTTPS until SIGTERM")
    serve.add_argument(
        "--listen",
        default="127.0.0.1:9443",
        metavar="HOST:PORT",
        help="address to listen on (default 127.0.0.1:9443; port 0 picks a free one)",
    )
    serve.add_argument(
        "--kubeconfig",
        metavar="PATH|in-cluster",
        help="watch nodes to reject requests larger than any GPU (default: skip those checks)",
    )
    serve.add_argument("--config", help="device-config.yaml (default: built-in defaults)")
    serve.add_argument(
        "--scheduler-name",
        default=TESSERA_SCHEDULER,
        help=f"Tessera's scheduler profile (default {TESSERA_SCHEDULER})",
    )
    serve.add_argument("--tls-cert-file", type=Path, help="serving certificate (PEM)")
    serve.add_argument("--tls-key-file", type=Path, help="its private key (PEM)")
    _cert_args(serve)
    serve.add_argument(
        "--trusted-user",
        action="append",
        default=[],
        metavar="USER",
        help="user allowed to preset internal annotations and nodeName on create and to "
        "change internal annotations on update: Tessera's plugin server and node agent, a "
        "restore tool (repeatable)",
    )
    serve.add_argument(
        "--host-only-pods",
        action="store_true",
        help="also give pods that ask for no GPU to Tessera's scheduler (it places them "
        "under the fragmentation policy); it must then be running for them to schedule",
    )
    serve.add_argument(
        "--host-only-exclude-namespace",
        action="append",
        default=[],
        type=_namespace,
        metavar="NAMESPACE",
        help="never route this namespace's pods without a GPU (repeatable; kube-system "
        "always; name Tessera's own namespace here)",
    )
    serve.add_argument("--address-file", type=Path, help="write HOST:PORT here once listening")
    serve.add_argument(
        "--watch-timeout", type=int, default=60, metavar="SECONDS", help="seconds per node watch"
    )
    serve.set_defaults(func=_cmd_serve)

    certs = sub.add_parser("certs", help="make (or reuse) a CA + serving cert; print caBundle")
    _cert_args(certs)
    certs.add_argument("--ca-bundle-out", type=Path, help="also write the caBundle here")
    certs.set_defaults(func=_cmd_certs)

    manifest = sub.add_parser("manifest", help="print the MutatingWebhookConfiguration")
    where = manifest.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="https://HOST:PORT/mutate the apiserver calls")
    where.add_argument("--service", metavar="NAMESPACE/NAME[:PORT]", help="in-cluster Service")
    manifest.add_argument("--path", default=MUTATE_PATH, help="path on the Service")
    ca = manifest.add_mutually_exclusive_group()
    ca.add_argument("--ca-file", type=Path, help="CA that signed the serving certificate")
    ca.add_argument("--cert-dir", type=Path, help="cert dir of `webhook certs` (uses ca.crt)")
    manifest.add_argument("--name", default=DEFAULT_NAME, help="configuration name")
    manifest.add_argument("--failure-policy", choices=("Fail", "Ignore"), default="Fail")
    manifest.add_argument("--timeout", type=int, default=5, help="seconds (1-30, default 5)")
    manifest.add_argument(
        "--exclude-namespace",
        action="append",
        metavar="NAME",
        help="namespace the webhook skips (repeatable; default kube-system)",
    )
    manifest.add_argument("--output", choices=("yaml", "json"), default="yaml")
    manifest.add_argument(
        "--trusted-user",
        action="append",
        default=[],
        metavar="USER",
        help="user whose pod updates are not sent to the webhook: Tessera's plugin server and "
        "node agent (e.g. system:serviceaccount:NS:NAME), as given to serve (repeatable)",
    )
    manifest.set_defaults(func=_cmd_manifest)
    return webhook


def _cert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cert-dir",
        type=Path,
        help=f"where generated certificates live (default {default_cert_dir()})",
    )
    p.add_argument(
        "--host",
        action="append",
        metavar="NAME|IP",
        help=f"serving certificate's name (repeatable; default {', '.join(DEFAULT_HOSTS)})",
    )


def _configure_logging() -> None:
    """JSON lines on stderr, unless the process configured structlog itself."""
    if not structlog.is_configured():
        structlog.configure(
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso"),
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        )


def _pki(args: argparse.Namespace) -> ServingPki:
    return ensure_serving_pki(args.cert_dir or default_cert_dir(), args.host or DEFAULT_HOSTS)


def serve_settings(args: argparse.Namespace, config: DeviceConfig) -> Settings:
    """The rules' settings from ``webhook serve``'s parsed flags (kube-system is always
    among the namespaces never routed)."""
    return Settings(
        args.scheduler_name,
        config,
        frozenset(args.trusted_user),
        host_only_pods=args.host_only_pods,
        host_only_exclude=HOST_ONLY_EXCLUDE | frozenset(args.host_only_exclude_namespace),
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from scheduler_plugins.webhook.app import WebhookApp
    from scheduler_plugins.webhook.server import parse_listen, server_ssl_context

    _configure_logging()
    host, port = parse_listen(args.listen)
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise WebhookSetupError("give both --tls-cert-file and --tls-key-file, or neither")
    if args.tls_cert_file is not None:
        cert, key = args.tls_cert_file, args.tls_key_file
    else:
        pki = _pki(args)
        cert, key = pki.cert, pki.key
        log.info("certificates", ca=str(pki.ca_cert), cert=str(cert))
    context = server_ssl_context(str(cert), str(key))
    config = load_config_file(args.config) if args.config else DeviceConfig()
    settings = serve_settings(args, config)
    kube = None
    if args.kubeconfig == IN_CLUSTER:
        kube = KubeClient.in_cluster(user_agent=USER_AGENT)
    elif args.kubeconfig:
        kube = KubeClient.from_kubeconfig(Path(args.kubeconfig), user_agent=USER_AGENT)
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    app = WebhookApp(
        settings, context, host=host, port=port, kube=kube, watch_timeout_s=args.watch_timeout
    )
    try:
        app.start(address_file=args.address_file)
        while not done.wait(1.0):
            pass
    finally:
        app.stop()
        if kube is not None:
            kube.close()
    return 0


def _cmd_certs(args: argparse.Namespace) -> int:
    _configure_logging()  # stdout is the answer
    pki = _pki(args)
    bundle = ca_bundle(pki.ca_cert)
    if args.ca_bundle_out:
        try:
            args.ca_bundle_out.write_text(bundle + "\n")
        except OSError as e:
            raise WebhookSetupError(f"cannot write {args.ca_bundle_out}: {e.strerror}") from e
    print(bundle)
    print(f"ca: {pki.ca_cert}  cert: {pki.cert}  key: {pki.key}", file=sys.stderr)
    return 0


def _cmd_manifest(args: argparse.Namespace) -> int:
    target = url_target(args.url) if args.url else service_target(args.service, args.path)
    ca_file = args.ca_file or (args.cert_dir or default_cert_dir()) / "ca.crt"
    obj = webhook_configuration(
        target,
        ca_bundle(ca_file),
        name=args.name,
        failure_policy=args.failure_policy,
        timeout_s=args.timeout,
        excluded_namespaces=args.exclude_namespace or ("kube-system",),
        trusted_users=args.trusted_user,
    )
    if args.output == "json":
        print(json.dumps(obj, indent=2))
    else:
        sys.stdout.write(yaml.safe_dump(obj, sort_keys=False))
    return 0
