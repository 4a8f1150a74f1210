"""Upload the generated dashboards to a Grafana server with ``grafana-client``.

Steps: find the folder whose title is ``folder`` (``GET /api/folders``), create it if missing
(``POST /api/folders``), then ``POST /api/dashboards/db`` each dashboard with
``overwrite: true`` and that folder's uid. Auth is the token as ``Authorization: Bearer``.
Dashboards are rendered fresh from the catalog (identical to ``dashboards/*.json``).
"""

from __future__ import annotations

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaException

from kvharbor.observability.catalog import DASHBOARDS
from kvharbor.observability.dashboards import build_dashboard

PUSH_MESSAGE = "kvharbor dashboards push"


class PushError(RuntimeError):
    """Grafana refused or could not be reached; the message says which step failed."""


def _folder_uid(api: GrafanaApi, title: str) -> str:
    """The uid of the folder titled ``title``, creating the folder if there is none."""
    for folder in api.folder.get_all_folders():
        if folder.get("title") == title:
            return folder["uid"]
    return api.folder.create_folder(title)["uid"]


def push_dashboards(url: str, token: str, folder: str, timeout_s: float = 10.0) -> list[str]:
    """Create or overwrite every kvharbor dashboard in ``folder``; returns their titles.

    Raises:
        PushError: the server answered with an error or could not be reached.
    """
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    step = f"find or create folder {folder!r}"
    try:
        folder_uid = _folder_uid(api, folder)
        titles = []
        for spec in DASHBOARDS:
            step = f"upload dashboard {spec.uid!r}"
            api.dashboard.update_dashboard({"dashboard": build_dashboard(spec),
                                            "folderUid": folder_uid, "overwrite": True,
                                            "message": PUSH_MESSAGE})
            titles.append(spec.title)
    except GrafanaException as exc:
        raise PushError(f"{step} at {url} failed: {exc} (check --url and that --token is a "
                        f"service-account token with dashboard write access)") from exc
    except Exception as exc:  # noqa: BLE001 - connection errors of the HTTP library
        raise PushError(f"{step} at {url} failed: {type(exc).__name__}: {exc}") from exc
    return titles
