"""A template that never names the developer role gets developer messages as system messages,
merged into one system message first when needed (vLLM's renderer); tests/conformance compares
echoed answers with the real frontends."""

from __future__ import annotations

from vllm_vcr.frontend.conversation import developer_as_system

PLAIN = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
AWARE = "{% for m in messages %}{% if m['role'] == 'developer' %}d{% endif %}{% endfor %}"


def test_developer_messages_become_one_system_message_first():
    dev = {"role": "developer", "content": "B.", "tools": [{"x": 1}]}
    user = {"role": "user", "content": "hi"}
    assert developer_as_system([dev, user], PLAIN) == [{"role": "system", "content": "B."}, user]
    # a system message that is not first, or several: one, first, texts joined by a blank line
    sys_a = {"role": "system", "content": "A.", "name": "x"}
    assert developer_as_system([sys_a, user, dev], PLAIN) == [{"role": "system", "content": "A.\n\nB."}, user]
    empty = {"role": "system", "content": ""}
    assert developer_as_system([user, empty, dev], PLAIN) == [{"role": "system", "content": "B."}, user]
    # left alone: a template that names the role, no developer message, no template
    for conv, template in (([dev, user], AWARE), ([sys_a, user, sys_a], PLAIN), ([dev], None)):
        assert developer_as_system(conv, template) is conv
