"""The two multi-turn workloads of ``bench_multiturn.py``: deterministic text, nothing downloaded.

* ``chat``: a shared system prompt of support policy (~1.3k SmolLM2 tokens in
  full), a per-conversation first message (the customer's situation), then
  short follow-up questions.
* ``agent``: a system prompt with the JSON schemas of eight tools, as agent
  frameworks send them (~1.2k tokens), a per-conversation task, then tool results.

``--quick`` sizes are short enough for the tiny test model's 2,048-token context.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prompts import CORPUS

POLICY_TOPICS = (
    "orders and payment", "shipping times", "returns", "exchanges", "warranty claims",
    "gift cards", "loyalty points", "product sizing", "care instructions", "store hours",
    "privacy and personal data", "damaged deliveries", "price matching", "bulk orders",
)  # fmt: skip
POLICY_RULES = (
    "When a customer asks about {topic}, restate the question in one short sentence first.",
    "State the rule for {topic} plainly, give every deadline or fee as a number, and never "
    "promise an exception that only a manager can grant.",
    "If the answer on {topic} depends on an order, ask for the order number before anything "
    "else, and do not guess the status of an order you cannot see.",
    "End each answer on {topic} with the single next step the customer should take.",
)
FOLLOW_UPS = (
    "Thanks. What is the very first thing I should do?",
    "And if that does not work, what then?",
    "How long will that take, roughly?",
    "Is there any fee involved?",
    "Can you sum it all up in two sentences?",
    "One more thing: can I do this in a store instead?",
)
TOOLS = (
    ("search_orders", "Find a customer's orders.", {"customer_id": "string", "since": "date"}),
    ("get_order", "One order with its items and status.", {"order_id": "string"}),
    ("refund_order", "Refund an order, fully or in part.",
     {"order_id": "string", "amount": "number", "reason": "string"}),
    ("send_email", "Email a customer.", {"to": "string", "subject": "string", "body": "string"}),
    ("search_docs", "Search the policy handbook.", {"query": "string", "top_k": "integer"}),
    ("get_weather", "Weather at a delivery address.", {"city": "string", "date": "date"}),
    ("create_ticket", "Open a support ticket.",
     {"title": "string", "priority": "string", "details": "string"}),
    ("schedule_pickup", "Book a courier pickup.",
     {"order_id": "string", "date": "date", "window": "string"}),
)  # fmt: skip
AGENT_TASKS = (
    "Customer {cid} says order {oid} arrived damaged. Check it, refund it if eligible, email them.",
    "Customer {cid} wants to return order {oid}. Book a pickup and confirm by email.",
    "Customer {cid} asks why order {oid} is late. Find out and open a ticket if needed.",
)


@dataclass(frozen=True)
class Workload:
    """A system prompt shared by every conversation, an opener each, then follow-ups."""

    name: str
    system: str
    openers: tuple[str, ...]
    follow_ups: tuple[str, ...]

    def user_message(self, conversation: int, turn: int) -> str:
        if turn == 1:
            return self.openers[conversation % len(self.openers)]
        return self.follow_ups[(conversation + turn - 2) % len(self.follow_ups)]


def corpus_text(rng: random.Random, words: int) -> str:
    start = rng.randrange(len(CORPUS))
    return " ".join(CORPUS[(start + i) % len(CORPUS)] for i in range(words))


def chat_workload(conversations: int, sections: int, context_words: int) -> Workload:
    policy = [
        f"Section {i + 1}: {topic}. " + " ".join(rule.format(topic=topic) for rule in POLICY_RULES)
        for i, topic in enumerate(POLICY_TOPICS[:sections])
    ]
    system = "You are the support assistant of Northwind Outfitters.\n\n" + "\n\n".join(policy)
    openers = tuple(
        f"Hello, I am customer {1000 + c}. Some background: "
        f"{corpus_text(random.Random(c), context_words)}\n\nMy order is late. What can I do?"
        for c in range(conversations)
    )
    return Workload("chat", system, openers, FOLLOW_UPS)


def tool_schema(name: str, description: str, params: dict[str, str]) -> dict[str, Any]:
    def prop(kind: str) -> dict[str, str]:
        if kind == "date":
            return {"type": "string", "format": "date", "description": "ISO 8601 date"}
        return {"type": kind, "description": f"the {kind} value"}

    parameters = {"type": "object", "properties": {k: prop(v) for k, v in params.items()},
                  "required": list(params), "additionalProperties": False}  # fmt: skip
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": parameters}}  # fmt: skip


def agent_workload(conversations: int, tools: int, context_words: int) -> Workload:
    schemas = json.dumps([tool_schema(*tool) for tool in TOOLS[:tools]], indent=2)
    system = (
        "You are an operations agent. To call a tool, answer with one JSON object "
        '{"tool": NAME, "arguments": {...}} and nothing else; after the last tool result, '
        f"answer the user in plain text.\n\nAvailable tools:\n{schemas}"
    )
    openers = tuple(
        AGENT_TASKS[c % len(AGENT_TASKS)].format(cid=2000 + c, oid=f"A{7300 + c}")
        + f"\nNotes: {corpus_text(random.Random(100 + c), context_words)}"
        for c in range(conversations)
    )
    follow_ups = tuple(
        f"Tool result ({name}): "
        + json.dumps({"status": "ok", "result": corpus_text(random.Random(200 + i), 12)})
        for i, (name, _, _) in enumerate(TOOLS[:tools])
    )
    return Workload("agent", system, openers, follow_ups)


def make_workloads(names: Sequence[str], conversations: int, quick: bool) -> list[Workload]:
    # Full: ~1.3k-token system prompts; quick: short ones for the tiny model's 2k context.
    build = {
        "chat": lambda: chat_workload(conversations, 2 if quick else 12, 20 if quick else 120),
        "agent": lambda: agent_workload(conversations, 2 if quick else 8, 10 if quick else 60),
    }
    unknown = sorted(set(names) - set(build))
    if unknown:
        raise SystemExit(f"unknown workload(s) {', '.join(unknown)}; known: chat, agent")
    return [build[name]() for name in names]
