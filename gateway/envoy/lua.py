"""Envoy's side of the usage feed: the Lua filter that reads each answer's token usage inside Envoy (so no token
passes through Python), and the access log that carries it with the answer's status to the picker (envoy/feed.py).

The picker marks a request it needs the count of (a key with a tokens-per-minute limit) in Envoy's dynamic
metadata (namespace USAGE_NAMESPACE: `count_usage`, and `hide_usage` when the gateway itself asked the engine for
the stream's usage chunk). For such a request the script looks at each response chunk as it passes, with a plain
string search: the last `"usage": {...}` object (a stream's usage chunk, an answer's body) goes into the same
metadata namespace as `total_tokens`, `prompt_tokens` and `completion_tokens`, and the time of the answer's
first token event (`first_token_ms`, for the per-class counts: gateway/slo_counts.py), which Envoy's access log
carries to the picker (envoy/feed.py). With `hide_usage` the usage-only SSE event is left out of the client's stream, as
the Python proxy does (usage.py); to drop it whole, a partial event waits for its end in the next chunk (a stream
cut mid-event loses that partial event). A request the degradation ladder changed carries `degraded`, which the
script sets as the answer's x-kvfleet-degraded header. Other requests cost one metadata lookup per answer.
"""

from __future__ import annotations

from kvfleet.fleet.headers import DEGRADED, FAULT

USAGE_NAMESPACE = "kvfleet"  # the request's dynamic metadata: the picker's ticket and flags, the usage counts
USAGE_FIELDS = ("total_tokens", "prompt_tokens", "completion_tokens")

# A usage object is a few dozen bytes: one split across two chunks starts within the previous chunk's last
# TAIL_BYTES. A partial SSE event is held for the next chunk (to be dropped whole if it is the usage chunk) up to
# MAX_HELD_BYTES; beyond that it is not SSE as we know it and passes on.
USAGE_LUA = r"""
local NS = "@NAMESPACE@"
local TAIL_BYTES = 512
local MAX_HELD_BYTES = 1048576

local function note_usage(handle, text)
  if string.find(text, '"usage"', 1, true) == nil then
    return
  end
  local last = nil
  for object in string.gmatch(text, '"usage"%s*:%s*(%b{})') do
    last = object
  end
  if last == nil then
    return
  end
  local metadata = handle:streamInfo():dynamicMetadata()
  for _, name in ipairs({@FIELDS@}) do
    local n = string.match(last, '"' .. name .. '"%s*:%s*(%d+)')
    if n ~= nil then
      metadata:set(NS, name, tonumber(n))
    end
  end
end

-- Whether `text` holds an SSE event that carries a token: a chunk with choices, not the role announcement an
-- engine sends before generating, nor a usage-only chunk (usage.is_token_event, the Python proxy's rule).
local function has_token_event(text)
  for event in string.gmatch(text, "data: {[^\n]*") do
    if string.find(event, '"choices"', 1, true) ~= nil and string.find(event, '"role"', 1, true) == nil
        and string.find(event, '"choices"%s*:%s*%[%s*%]') == nil then
      return true
    end
  end
  return false
end

local function is_usage_event(event)
  return string.sub(event, 1, 7) == "data: {" and string.find(event, '"usage"', 1, true) ~= nil
    and string.find(event, '"choices"%s*:%s*%[%s*%]') ~= nil
end

-- The complete events of `text` without the usage-only one, and the partial event left at its end.
local function without_usage_event(text)
  if string.find(text, '"usage"', 1, true) == nil and string.sub(text, -2) == "\n\n" then
    return text, ""
  end
  local out, start = {}, 1
  while true do
    local s, e = string.find(text, "\n\n", start, true)
    if s == nil then
      break
    end
    local event = string.sub(text, start, e)
    if not is_usage_event(event) then
      out[#out + 1] = event
    end
    start = e + 1
  end
  local rest = string.sub(text, start)
  if #rest > MAX_HELD_BYTES then
    out[#out + 1] = rest
    rest = ""
  end
  return table.concat(out), rest
end

function envoy_on_response(handle)
  local flags = handle:streamInfo():dynamicMetadata():get(NS)
  if flags ~= nil and flags["degraded"] ~= nil then
    handle:headers():replace("@DEGRADED@", flags["degraded"])
  end
  if flags == nil or flags["count_usage"] ~= true then
    return
  end
  local content_type = handle:headers():get("content-type") or ""
  local stream = string.find(content_type, "text/event-stream", 1, true) ~= nil
  local hide = flags["hide_usage"] == true and stream
  local tail, held, first_token = "", "", false
  for chunk in handle:bodyChunks() do
    local data = chunk:getBytes(0, chunk:length())
    -- the first token's time (ms since the epoch): a stream's first token event; an unstreamed answer's first
    -- bytes, as its first token is not visible before the whole answer
    if not first_token and (not stream or has_token_event(data)) then
      first_token = true
      handle:streamInfo():dynamicMetadata():set(NS, "first_token_ms", handle:timestamp())
    end
    local window = tail .. data
    note_usage(handle, window)
    tail = string.sub(window, -TAIL_BYTES)
    if hide then
      local out
      out, held = without_usage_event(held == "" and data or held .. data)
      if out ~= data then  -- most chunks are one whole event, passed on untouched
        chunk:setBytes(out)
      end
    end
  end
end
""".replace("@NAMESPACE@", USAGE_NAMESPACE).replace("@FIELDS@", ", ".join(f'"{f}"' for f in USAGE_FIELDS)).replace(
    "@DEGRADED@", DEGRADED)
ACCESS_LOG_FLUSH_S = 0.25  # Envoy sends its buffered entries this often (or sooner when the buffer fills)


def lua_filter() -> dict:
    """The HTTP filter entry for Envoy's bootstrap (before the router)."""
    return {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": USAGE_LUA}}}


def usage_access_log(cluster: str) -> dict:
    """The connection manager's access log: one entry per request the picker routed (those with a ticket), streamed
    over gRPC to the picker's access log service on `cluster`."""
    ticket = {"filter": USAGE_NAMESPACE, "path": [{"key": "ticket"}], "value": {"present_match": True}}
    return {**_grpc_log(cluster), "filter": {"metadata_filter": {"matcher": ticket}}}


def attempt_access_log(cluster: str) -> dict:
    """The router's upstream log: one entry per attempt at an upstream (the picker keeps the engines' ones), so a
    failed attempt that Envoy retried elsewhere still counts toward its engine's ejection."""
    return _grpc_log(cluster)


def _grpc_log(cluster: str) -> dict:
    # One configuration for both logs: Envoy then sends their entries on one gRPC stream.
    return {"name": "envoy.access_loggers.http_grpc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
        "common_config": {"log_name": "kvfleet", "transport_api_version": "V3",
                          "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                          "buffer_flush_interval": f"{ACCESS_LOG_FLUSH_S}s", "buffer_size_bytes": 16384},
        "additional_response_headers_to_log": [FAULT]}}
