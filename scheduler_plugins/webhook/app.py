"""``WebhookApp``: the node watch that keeps cluster facts current, plus the HTTPS server.

Without a Kubernetes client the facts stay unknown and the cluster checks are skipped (the
webhook still guards internal annotations, fills defaults and validates values). With one,
``/readyz`` answers 200 once the first node list is in.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import structlog

from api.kube.reflector import Kube, Reflector
from scheduler_plugins.webhook.facts import NodeFactsStore
from scheduler_plugins.webhook.review import Answer, answer
from scheduler_plugins.webhook.rules import Settings
from scheduler_plugins.webhook.server import WebhookServer

log = structlog.get_logger("tessera.webhook")

NODES = "/api/v1/nodes"


class WebhookApp:
    def __init__(
        self,
        settings: Settings,
        ssl_context: ssl.SSLContext,
        *,
        host: str,
        port: int,
        kube: Kube | None = None,
        watch_timeout_s: int = 60,
    ) -> None:
        self.settings = settings
        self.nodes = NodeFactsStore()
        self._reflector = (
            Reflector(
                kube,
                NODES,
                on_list=self.nodes.replace,
                on_event=self.nodes.event,
                watch_timeout_s=watch_timeout_s,
            )
            if kube is not None
            else None
        )
        self.server = WebhookServer(self.handle, ssl_context, host, port, ready=self.ready)

    def handle(self, body: bytes) -> Answer:
        return answer(body, self.nodes.facts(), self.settings)

    def ready(self) -> bool:
        return self._reflector is None or self.nodes.synced.is_set()

    def start(self, *, address_file: Path | None = None) -> None:
        if self._reflector is not None:
            self._reflector.start()
        else:
            log.warning("no kubeconfig: node facts unknown, cluster checks skipped")
        self.server.start()
        if address_file is not None:
            # Written last: whoever waits for it finds a server that accepts connections.
            host, port = self.server.address
            tmp = address_file.with_name(address_file.name + ".tmp")
            tmp.write_text(f"{host}:{port}\n")
            tmp.replace(address_file)

    def stop(self) -> None:
        self.server.stop()
        if self._reflector is not None:
            self._reflector.stop()

    def __enter__(self) -> WebhookApp:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
