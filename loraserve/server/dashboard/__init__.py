"""The dashboard's static files (HTML, CSS, ES modules): no build step, nothing from a CDN.

The names the server serves, and the only ones: server/dashboard_routes.py serves these and
server/auth.py lets anyone fetch them (they hold no data).
"""

PAGE = "/dashboard"
STATIC = ("index.html", "style.css", "app.js", "api.js", "prom.js", "charts.js", "live.js",
          "adapters.js", "tenants.js", "playground.js", "sse.js", "diff.js")
PATHS = frozenset({PAGE, *(f"{PAGE}/{name}" for name in STATIC)})
