"""OpenAI-compatible gateway: sessions, chat-template rendering, token-faithful recording.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` (also under the
session prefix `/s/<session_id>/v1`), `POST /v1/sessions`, `GET /v1/sessions/<id>`,
`POST /v1/sessions/<id>/reward`, `POST /v1/sessions/<id>/finish`, health and metrics.

Session identity: the URL prefix `/s/<session_id>/v1` (a session made by `POST /v1/sessions`),
or the header `X-Session-Id: <id>` on `/v1/...` (a live-mode session is created on first use).
`X-Turn-Type: main` (default) turns are recorded; `side` turns (a harness's auxiliary calls:
summaries, titles, memory) are served with the session's engine affinity but never recorded
and never count as the next state of a turn.

Samples (proto/flywheel/v1/sample.proto) published to the rollouts stream:

- Episode mode: one Sample per segment, all published when the session finishes (a request
  that rewrites history, or a turn sampled at another temperature/top_p/top_k/min_p, starts a
  new segment; the closed one is held until the finish): `token_ids` = the first prompt, then
  every sampled turn
  and the template tokens between turns; `loss_mask` 1 on every sampled token; `messages` the
  whole conversation; `rewards` = what was posted to `/reward` plus the finish `reward` as
  `rewards["outcome"]`.
- Live mode: one Sample per main assistant turn, published when its next state arrives (a
  later main request whose history extends the turn's, or the session's finish; parallel
  requests on one history are branches, each turn its own Sample, see branches.py; an idle
  session is finished by the gateway after `gateway.session_idle_finish_s`, see sweep.py):
    token_ids        exact prompt ids of the turn (earlier turns' sampled ids as sampled) +
                     the turn's sampled ids, EOS included; prompt_length = len(prompt ids)
    loss_mask        1 only on the turn's sampled ids
    rollout_logprobs the engine's logprob (at the sampling temperature) on those ids, 0 elsewhere
    weight_versions  the engine's weight version on those ids, -1 elsewhere
    messages         the request's messages + the assistant reply as the client got it (last)
    next_state       role + content_json of what followed: the first following message's role;
                     its content, or the text contents of all following messages joined by a
                     blank line; extra_json = its other fields (tool_call_id) and, when several
                     followed, all of them as "messages". Absent when no later request
                     extended the turn and the finish body had no `next_state` for it.
    turn_index       the turn's index in the session; segment_index its segment
    sample_id        uuid5 of "<session>/turn/<turn_index>[/choice/<k>]" (a re-publish dedupes)
    sampling, tools_json, task_json, finish_reason (stop | length | tool_calls), group_id
    rewards          whatever was posted to `/v1/sessions/<id>/reward` while the turn waited
- n > 1 in a session: the choices share `group_id`; the one the client sends back continues the
  session, each other choice becomes its own Sample (loss mask on it only), published with the
  request that sends the chosen one back in live mode and at the finish in episode mode.

Per token: `weight_versions` from the engine's `weight_versions` spans when an update landed
during the request. A generation the engine returned past a stop is cut at the stop
(engines/stops.py); one it aborted is asked again once and never recorded (engines/pool.py).

Delivery: a request's Samples are added to the stream by the same Redis script that saves the
session record and releases its lock (session/store.py), so a failed request or a gateway killed
mid-turn publishes none of them and a saved turn all of them, once. A request whose client
disconnects before its answer is stopped and not recorded (api/disconnect.py). A gateway keeps
the records it saved (recording/record_cache.py): the session's next turn there reads no record from
Redis while the stored one is still the version it saved (another replica's save, or any other
write, makes it read again).

Layout (the path of a turn, docs/architecture.md): app.py (routes) and deps.py (`GatewayDeps`,
what every route is given); api/ (one module per wire API: request in, response and stream
events out); render/ (chat template and tokenization, the only text -> ids); session/ (the Redis
store, its lock, a turn's stitching into its session, branches, pending turns, finish, idle
sweep); engines/ (the `Generation` type, the pool and its plain and streamed `/generate`
clients, stops); recording/ (the typed session record, what a turn appends and when it forks,
the Sample built from it at publish); access/ (keys, roles, limits); dashboard.py (/dashboard).
"""
