"""Server-rendered HTML pages of the evaluation API: the leaderboard, an evaluation, a policy.

Where they live: under their own prefix, so no JSON route changes meaning with the
``Accept`` header and caches and clients never get one for the other.

- ``/`` redirects (307) to ``/ui/``.
- ``/ui/?suite=NAME[&include_nonstandard=true]`` — the suites with results as tabs
  (each with the number of policies it ranks; the others under a fold) and the chosen
  suite's leaderboard (the busiest suite when none is named): rank, policy, success
  rate, its Wilson 95% interval drawn as a bar with whiskers, episodes, date. Every
  ranked policy (up to 1,000) is in the page, the first 100 shown and the rest behind
  "Show all"; columns sort on click, over all rows.
- ``/ui/evaluations/{id}[?after=INDEX]`` — status, progress and counts, overall
  results, per-task success bars with whiskers, a histogram of per-episode mean policy
  latency with the evaluation's p50/p95, and the episodes table (500 rows a page), with
  each episode's replay GIF where a worker recorded one. While the evaluation is not
  finalised a small inline script polls ``GET /evaluations/{id}`` (JSON) every 2 s and
  updates the status, progress bar, counts and overall figures; when episodes have
  finished it re-renders the charts and the table in place (at most every 10 s, by
  fetching the page itself), and it reloads the page once the evaluation is finalised.
- ``/ui/episodes/{id}/replay.gif`` — an episode's replay, read from ``ARTIFACT_ROOT``
  (``ApiSettings.artifact_root``: the workers' directory as the API host sees it) at
  the relative path its row records (``episodes.artifact_path``); never outside it.
- ``/ui/policies/{id}`` — the policy's metadata, its success rate per suite over time
  (a line per suite with interval bands, a point per finished evaluation), and its
  evaluations.

None of these is in the OpenAPI schema. Plots are SVG drawn on the server (``plots``);
the CSS and the two small scripts (column sorting, live progress) are inline, so the
pages need nothing from the internet. Figures come from the store's own queries and
aggregates (``services.store.queries``, ``services.store.aggregates``).

Access follows the API's read rule: when ``EVALFORGE_READS_NEED_KEY`` is set, a page
needs ``Authorization: Bearer <key>`` like any read, and answers 401 (no key) or 403
(unknown key) with a short HTML page saying so. A browser cannot add that header by
itself; put a proxy that adds it in front of the API, or leave reads open.
"""

from services.eval_api.pages.routes import router

__all__ = ["router"]
