"""ASGI plumbing the two HTTP services share (the scheduler API's guard, scheduler/service/api/guard.py,
and the data manager's auth middleware, datamanager/auth.py): a request body capped while it
streams in, paths with control characters refused, and JSON replies sent before any route runs.
No policy lives here: each service decides who may call what and answers its own status codes."""

from http_guard.body import BodyTooLarge, capped_receive, send_json
from http_guard.paths import BAD_PATH_DETAIL, has_control_character

__all__ = ["BAD_PATH_DETAIL", "BodyTooLarge", "capped_receive", "has_control_character", "send_json"]
