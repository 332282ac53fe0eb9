"""Print a small JSONL sample for `prme ingest` (one message per line).

Each line carries a fixed ``request_id``, so ingesting the sample twice (``make demo``
run again) writes nothing the second time."""

import json

TURNS = [
    ("alice", "support-42", "user", "Use dark mode in every editor."),
    ("alice", "support-42", "assistant", "I will remember that you prefer dark mode."),
    ("alice", "planning", "user", "Aurora needs approval from Dana before deployment."),
    ("alice", "planning", "user", "We decided to ship Aurora on Friday 12 December."),
    ("bob", "travel", "user", "I love hiking in the Alps; next trip is 3 weeks long."),
    ("bob", "travel", "assistant", "Noted: a 3 week hiking trip in the Alps."),
]

for number, (owner, session, role, content) in enumerate(TURNS, start=1):
    line = {"owner": owner, "session": session, "role": role, "content": content}
    print(json.dumps({**line, "request_id": f"sample-{number}"}))
