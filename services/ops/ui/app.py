"""`streamrl ui`: the HTTP routes. Pages are one HTML shell (static/shell.html) that static/ui.js fills from the
JSON routes under /api; the charts are Plotly's, its plotly.min.js served from the installed ``plotly`` package
(no CDN: the pages work offline). Read-only: no route writes to a run.

    GET /                          runs           GET /api/runs
    GET /run/<run>                 run            GET /api/run/<run>?since=STEP       (live: polled)
                                                  GET /api/run/<run>/check            (an ended run's check)
    GET /run/<run>/episodes        episodes       GET /api/run/<run>/episodes?outcome=&min_aborts=&sort=&...
    GET /run/<run>/ep/<episode>    episode        GET /api/run/<run>/ep/<episode>

With a key (``gateway_api_key``, the gateway's), every route but /healthz wants it: ``Authorization: Bearer
KEY``, or ``?key=KEY`` once, which sets a cookie for the rest of the visit.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from urllib.parse import urlencode

import redis
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from services.ops.inspect import runs as runs_mod
from services.ops.ui import queries
from services.ops.ui.episode_view import episode_view
from services.ops.ui.index import row_json
from services.ops.ui.run_view import read_run_view
from services.ops.ui.sources import NoRun, Sources
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.runtime import secrets

STATIC = Path(__file__).parent / "static"
COOKIE = "streamrl_ui_key"
PAGES = {"runs": "runs", "run": "run", "episodes": "episodes", "episode": "episode"}


def plotly_js() -> Path:
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.exists():
        raise RuntimeError(f"plotly package at {path.parent.parent} has no package_data/plotly.min.js")
    return path


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def make_app(sources: Sources, api_key: str = "", is_live=None) -> FastAPI:
    app = FastAPI(title="streamrl ui", docs_url=None, redoc_url=None, openapi_url=None)
    log = structlog.get_logger("ui")
    shell = (STATIC / "shell.html").read_text()
    plotly_path = plotly_js()

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key and request.url.path != "/healthz":
            given = request.query_params.get("key") or request.cookies.get(COOKIE, "")
            header = request.headers.get("authorization", "")
            if header.startswith("Bearer "):
                given = header.removeprefix("Bearer ").strip()
            if not secrets.same(given, api_key):
                log.warning("request refused: wrong key", path=request.url.path[:200])
                if request.url.path.startswith("/api/"):
                    return _error(
                        401,
                        "authorization: missing or wrong key (Bearer token, or ?key= once in the "
                        "browser; the key is the run's gateway_api_key: docs/security.md)",
                    )
                return HTMLResponse(
                    "<h1>401</h1><p>streamrl ui wants its key: open the URL `streamrl ui` printed "
                    "(…?key=…), or send <code>Authorization: Bearer KEY</code>.</p>",
                    401,
                )
            # once: a cookie from now on, and the key out of the address bar
            if "key" in request.query_params:
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "key"]
                target = request.url.path + ("?" + urlencode(rest) if rest else "")
                out = RedirectResponse(target, 303)
                out.set_cookie(COOKIE, api_key, httponly=True, samesite="strict")
                return out
        try:
            return await call_next(request)
        except NoRun as exc:
            return _error(404, str(exc))
        except redis.exceptions.RedisError as exc:
            folder = request.path_params.get("run") if hasattr(request, "path_params") else None
            parts = request.url.path.split("/")
            sources.forget(folder or (parts[3] if len(parts) > 3 and parts[1] == "api" else ""))
            return _error(
                503, f"Redis: {exc} (the run's server went away? reload: an ended run is read from its folder)"
            )

    def page(kind: str, title: str) -> HTMLResponse:
        return HTMLResponse(shell.replace("{{PAGE}}", kind).replace("{{TITLE}}", html.escape(title)))

    @app.get("/healthz")
    def healthz():
        return {"ok": True}

    @app.get("/static/plotly.min.js")
    def plotly_file():
        return FileResponse(plotly_path, media_type="application/javascript")

    @app.get("/static/{name}")
    def static(name: str):
        path = STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            return _error(404, f"no static file {name!r}")
        return FileResponse(path)

    @app.get("/")
    def runs_page():
        return page("runs", "streamrl runs")

    @app.get("/run/{run}")
    def run_page(run: str):
        sources.folder_path(run)
        return page("run", f"run {run}")

    @app.get("/run/{run}/episodes")
    def episodes_page(run: str):
        sources.folder_path(run)
        return page("episodes", f"episodes of {run}")

    @app.get("/run/{run}/ep/{episode}")
    def episode_page(run: str, episode: str):
        sources.folder_path(run)
        return page("episode", f"episode {episode}")

    @app.get("/api/runs")
    def api_runs():
        live = is_live or (lambda folder, marker: False)
        return runs_mod.as_json(runs_mod.list_runs(Path(sources.cfg.run_dir), live))

    @app.get("/api/run/{run}")
    def api_run(run: str, since: int = -1):
        src = sources.get(run)
        src.refresh_soon()
        view = read_run_view(src.client, src.keys, src.path, since)
        view.update(
            run=run,
            served=src.served,
            ended=src.ended,
            episodes=len(src.index.table),
            policy_tokens=src.index.policy_tokens(),
            outcomes=src.index.counts(),
            index_built=src.ready,
            index_error=src.error,
            has_data=src.client is not None,
        )
        return view

    @app.get("/api/run/{run}/check")
    def api_check(run: str):
        src = sources.get(run)
        if src.client is None:
            return _error(409, f"run {run!r}: no server holds it and its folder has no Redis data to check")
        if src.check is None:
            from services.ops.check.checker import check, read_run
            from services.ops.check.report import format_report

            report = check(read_run(src.client, src.keys, src.path, None, src.target.cfg))
            src.check = {"ok": report.ok, "report": report.to_json(), "text": format_report(report, run)}
        return src.check

    @app.get("/api/run/{run}/episodes")
    def api_episodes(run: str, request: Request):
        try:
            q = queries.parse(request.query_params)
        except queries.QueryError as exc:
            return _error(400, str(exc))
        src = sources.get(run)
        src.refresh_soon()
        t0 = time.perf_counter()
        total, rows = src.index.query(q.filters, q.sort, q.desc, q.offset, q.limit)
        return {
            "total": total,
            "offset": q.offset,
            "limit": q.limit,
            "rows": [row_json(s) for s in rows],
            "indexed": len(src.index.table),
            "built": src.ready,
            "progress": src.index.progress,
            "query_ms": round((time.perf_counter() - t0) * 1000, 2),
            "error": src.error,
        }

    @app.get("/api/run/{run}/ep/{episode}")
    def api_episode(run: str, episode: str, routes_under: int | None = None):
        src = sources.get(run)
        if src.client is None:
            return _error(404, f"run {run!r}: no server holds it and its folder has no Redis data")
        entries = EpisodeLog(src.client, src.keys, worker="ui", archive=src.archive).read(episode)
        if not entries:
            return _error(404, f"no episode {episode!r} in run {run!r}")
        try:
            ep = fold(entries)
        except EventError as exc:
            return _error(422, f"episode {episode}: {exc}")
        view = episode_view(ep, run, _decoder(src))
        if routes_under is not None:
            # a mixture-of-experts episode: the routes another version's routers choose (a forward on this machine)
            from services.ops.replay import routes
            from services.ops.replay.text import ReplayError

            log_ = EpisodeLog(src.client, src.keys, worker="ui", archive=src.archive)
            try:
                view["routes_under"] = routes.compare(src.target.cfg, log_, ep, routes_under)
            except ReplayError as exc:
                return _error(422, str(exc))
        return view

    def _decoder(src):
        if not hasattr(src, "decode_text"):
            from services.ops.replay.text import ReplayError, decoder

            try:
                src.decode_text = decoder(src.target.cfg)
            except (ReplayError, OSError, ValueError) as exc:
                log.warning("no tokenizer: token ids shown", run=src.folder, error=str(exc))
                src.decode_text = None
        return src.decode_text

    @app.get("/favicon.ico")
    def favicon():
        return Response(status_code=204)

    return app
