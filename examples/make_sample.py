"""Print a small JSONL sample for `prme ingest` (one message per line)."""

import json

TURNS = [
    ("alice", "support-42", "user", "Use dark mode in every editor."),
    ("alice", "support-42", "assistant", "I will remember that you prefer dark mode."),
    ("alice", "planning", "user", "Aurora needs approval from Dana before deployment."),
    ("alice", "planning", "user", "We decided to ship Aurora on Friday 12 December."),
    ("bob", "travel", "user", "I love hiking in the Alps; next trip is 3 weeks long."),
    ("bob", "travel", "assistant", "Noted: a 3 week hiking trip in the Alps."),
]

for owner, session, role, content in TURNS:
    print(json.dumps({"owner": owner, "session": session, "role": role, "content": content}))
