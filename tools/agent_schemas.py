#!/usr/bin/env python3
"""agent_schemas.py -- the JSON schemas of the kind agents send, and valid texts for them.

Writes bench/grammar/NN_name.json (a schema: tool parameters, nested objects
with enums and arrays, $defs the way pydantic writes them, anyOf nullables,
formats, patterns, bounds) and bench/grammar/NN_name.jsonl (JSON Lines: each
line a JSON string holding one valid instance, written as a model writes it:
compact, with json.dumps' ", " / ": ", or indented), for `k3 grammar --test`
(bench/grammar.sh times them; tests/test_grammar.c checks every text is
accepted). Every instance is checked with the `jsonschema` package before it
is written. Deterministic (seeded).

Usage: sh scripts/venv.sh jsonschema && .venv/bin/python tools/agent_schemas.py
"""
import json
import os
import random
import sys

import jsonschema

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "grammar")

WORDS = ("the quick brown fox jumps over a lazy dog while agents call tools to read files search the web "
         "book flights send email and summarize long documents for their users in many languages").split()


def s(**kw):
    return dict(type="string", **kw)


def i(**kw):
    return dict(type="integer", **kw)


def n(**kw):
    return dict(type="number", **kw)


def b(**kw):
    return dict(type="boolean", **kw)


def arr(items, **kw):
    return dict(type="array", items=items, **kw)


def obj(props, req=None, addl=False, **kw):
    o = dict(type="object", properties=props)
    if req is None:
        req = list(props)
    if req:
        o["required"] = req
    if addl is not None:
        o["additionalProperties"] = addl
    o.update(kw)
    return o


def nullable(x):
    return {"anyOf": [x, {"type": "null"}]}


def enum(*v):
    return {"type": "string", "enum": list(v)}


SCHEMAS = [
    ("get_weather", obj({"location": s(description="City and country"), "unit": enum("celsius", "fahrenheit")},
                        req=["location"])),
    ("read_file", obj({"path": s(), "offset": i(minimum=0), "limit": i(minimum=1, maximum=2000)}, req=["path"])),
    ("write_file", obj({"path": s(), "content": s(), "create_dirs": b()}, req=["path", "content"])),
    ("edit_file", obj({"path": s(), "old_string": s(), "new_string": s(), "replace_all": b()},
                      req=["path", "old_string", "new_string"])),
    ("run_shell", obj({"command": s(), "timeout_ms": i(minimum=1, maximum=600000), "cwd": s(),
                       "env": {"type": "object", "additionalProperties": s()}}, req=["command"])),
    ("web_search", obj({"query": s(minLength=1, maxLength=400), "num_results": i(minimum=1, maximum=20),
                        "freshness": enum("day", "week", "month", "any"),
                        "domains": arr(s(), maxItems=10)}, req=["query"])),
    ("fetch_url", obj({"url": s(format="uri"), "method": enum("GET", "POST", "PUT", "DELETE", "PATCH"),
                       "headers": {"type": "object", "additionalProperties": s()}, "body": nullable(s())},
                      req=["url", "method"])),
    ("send_email", obj({"to": arr(s(format="email"), minItems=1), "cc": arr(s(format="email")), "subject": s(maxLength=200),
                        "body": s(), "priority": enum("low", "normal", "high")}, req=["to", "subject", "body"])),
    ("create_event", obj({"title": s(), "start": s(format="date-time"), "end": s(format="date-time"),
                          "attendees": arr(obj({"email": s(format="email"), "optional": b()}, req=["email"])),
                          "location": nullable(s()), "reminders": arr(i(minimum=0, maximum=10080), maxItems=5)},
                         req=["title", "start", "end"])),
    ("sql_query", obj({"database": enum("analytics", "billing", "users"), "query": s(),
                       "params": arr({"type": ["string", "number", "boolean", "null"]}), "max_rows": i(minimum=1)},
                      req=["database", "query"])),
    ("git_commit", obj({"message": s(minLength=3), "files": arr(s(), minItems=1), "amend": b(),
                        "author": obj({"name": s(), "email": s(format="email")})}, req=["message", "files"])),
    ("github_issue", obj({"repo": s(pattern="^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$"), "title": s(), "body": s(),
                          "labels": arr(enum("bug", "enhancement", "question", "documentation"), uniqueItems=False),
                          "assignees": arr(s())}, req=["repo", "title"])),
    ("book_flight", obj({"origin": s(pattern="^[A-Z]{3}$"), "destination": s(pattern="^[A-Z]{3}$"),
                         "date": s(format="date"), "return_date": nullable(s(format="date")),
                         "passengers": obj({"adults": i(minimum=1, maximum=9), "children": i(minimum=0, maximum=8)},
                                           req=["adults"]),
                         "cabin": enum("economy", "premium_economy", "business", "first")},
                        req=["origin", "destination", "date", "passengers"])),
    ("order_items", obj({"customer_id": s(format="uuid"),
                         "items": arr(obj({"sku": s(pattern="^[A-Z]{2}-[0-9]{4}$"), "qty": i(minimum=1, maximum=99),
                                           "price": n(minimum=0)}), minItems=1, maxItems=20),
                         "shipping": obj({"address": s(), "city": s(), "zip": s(pattern="^[0-9]{5}$"),
                                          "country": enum("US", "CA", "MX")}),
                         "gift": b()}, req=["customer_id", "items", "shipping"])),
    ("translate", obj({"text": s(), "source_lang": s(pattern="^[a-z]{2}$"), "target_lang": s(pattern="^[a-z]{2}$"),
                       "formality": enum("default", "more", "less")}, req=["text", "target_lang"])),
    ("summarize", obj({"document": s(), "max_words": i(minimum=10, maximum=1000), "style": enum("bullets", "paragraph"),
                       "focus": arr(s(), maxItems=5)}, req=["document"])),
    ("classify_ticket", obj({"category": enum("billing", "technical", "account", "other"),
                             "urgency": i(minimum=1, maximum=5), "sentiment": n(minimum=-1, maximum=1),
                             "summary": s(maxLength=280), "needs_human": b()})),
    ("extract_entities", obj({"people": arr(obj({"name": s(), "role": nullable(s())})),
                              "organizations": arr(s()), "dates": arr(s(format="date")),
                              "amounts": arr(obj({"value": n(), "currency": s(pattern="^[A-Z]{3}$")}))})),
    ("code_review", obj({"verdict": enum("approve", "request_changes", "comment"),
                         "comments": arr(obj({"file": s(), "line": i(minimum=1), "severity": enum("nit", "minor", "major"),
                                              "text": s()})), "summary": s()})),
    ("plan_steps", obj({"goal": s(), "steps": arr(obj({"id": i(minimum=1), "action": s(),
                                                      "depends_on": arr(i(minimum=1)), "tool": nullable(s())}),
                                                 minItems=1)})),
    ("calculator", obj({"expression": s(pattern="^[0-9+*/(). -]+$"), "precision": i(minimum=0, maximum=15)},
                       req=["expression"])),
    ("set_reminder", obj({"text": s(), "at": s(format="date-time"), "repeat": enum("none", "daily", "weekly", "monthly")},
                         req=["text", "at"])),
    ("search_products", obj({"query": s(), "category": nullable(enum("books", "electronics", "home", "toys")),
                             "price_min": n(minimum=0), "price_max": n(minimum=0), "in_stock": b(),
                             "sort": enum("relevance", "price_asc", "price_desc", "rating"),
                             "page": i(minimum=1, maximum=100)}, req=["query"])),
    ("update_crm", obj({"contact_id": s(pattern="^C[0-9]{6}$"), "fields": obj({"stage": enum("lead", "qualified", "won",
                                                                                             "lost"),
                                                                                "value": n(minimum=0),
                                                                                "notes": s()}, req=[]),
                        "log_activity": b()}, req=["contact_id", "fields"])),
    ("kubectl", obj({"action": enum("get", "describe", "logs", "apply", "delete", "scale"),
                     "resource": enum("pod", "deployment", "service", "configmap"), "name": s(),
                     "namespace": s(pattern="^[a-z0-9-]{1,63}$"), "replicas": i(minimum=0, maximum=100)},
                    req=["action", "resource"])),
    ("ui_click", obj({"selector": s(), "button": enum("left", "right", "middle"), "x": i(), "y": i(),
                      "modifiers": arr(enum("shift", "ctrl", "alt", "meta"), maxItems=4)}, req=["selector"])),
    ("browser_nav", obj({"url": s(format="uri"), "wait_until": enum("load", "domcontentloaded", "networkidle"),
                         "timeout_s": n(exclusiveMinimum=0, maximum=120)}, req=["url"])),
    ("image_gen", obj({"prompt": s(minLength=3), "size": enum("256x256", "512x512", "1024x1024"),
                       "n": i(minimum=1, maximum=4), "seed": nullable(i(minimum=0)), "style": enum("vivid", "natural")},
                      req=["prompt"])),
    ("geo_lookup", obj({"lat": n(minimum=-90, maximum=90), "lon": n(minimum=-180, maximum=180),
                        "radius_m": i(minimum=1, maximum=50000), "kinds": arr(enum("cafe", "park", "museum", "hotel"))},
                       req=["lat", "lon"])),
    ("stock_quote", obj({"symbol": s(pattern="^[A-Z]{1,5}$"), "interval": enum("1m", "5m", "1h", "1d"),
                         "start": s(format="date"), "end": s(format="date")}, req=["symbol"])),
    ("memory_store", obj({"key": s(maxLength=64), "value": {}, "ttl_s": nullable(i(minimum=1)),
                          "tags": arr(s(maxLength=32), maxItems=8)}, req=["key", "value"])),
    ("notify", obj({"channel": enum("slack", "email", "sms", "push"), "recipients": arr(s(), minItems=1),
                    "message": s(maxLength=1000), "urgent": b()}, req=["channel", "recipients", "message"])),
    ("transfer_money", obj({"from_account": s(pattern="^[0-9]{10}$"), "to_account": s(pattern="^[0-9]{10}$"),
                            "amount": n(exclusiveMinimum=0, maximum=10000, multipleOf=0.01),
                            "currency": enum("USD", "EUR", "GBP"), "memo": s(maxLength=140)},
                           req=["from_account", "to_account", "amount", "currency"])),
    ("diagnose", obj({"symptoms": arr(s(), minItems=1), "duration_days": i(minimum=0),
                      "severity": i(minimum=1, maximum=10), "age": i(minimum=0, maximum=120),
                      "sex": enum("female", "male", "other", "unknown")}, req=["symptoms"])),
    ("recipe", obj({"title": s(), "servings": i(minimum=1, maximum=24),
                    "ingredients": arr(obj({"name": s(), "amount": n(minimum=0), "unit": enum("g", "ml", "tsp", "tbsp",
                                                                                               "cup", "piece")})),
                    "steps": arr(s(), minItems=1), "vegetarian": b()})),
    ("movie_review", obj({"title": s(), "year": i(minimum=1888, maximum=2030), "rating": n(minimum=0, maximum=10),
                          "pros": arr(s()), "cons": arr(s()), "recommend": b()})),
    ("json_patch", arr(obj({"op": enum("add", "remove", "replace", "move", "copy", "test"),
                            "path": s(format="json-pointer"), "value": {}}, req=["op", "path"]), minItems=1)),
    ("contact_card", obj({"name": obj({"first": s(), "last": s()}), "phones": arr(obj({"kind": enum("home", "work",
                                                                                                  "mobile"),
                                                                                     "number": s(pattern="^\\+?[0-9 -]{7,20}$")})),
                          "emails": arr(s(format="email")), "birthday": nullable(s(format="date")),
                          "website": nullable(s(format="uri"))}, req=["name"])),
    ("feature_flags", obj({"flags": {"type": "object", "additionalProperties": b()}, "env": enum("dev", "staging",
                                                                                                 "prod"),
                           "rollout_pct": i(minimum=0, maximum=100)}, req=["flags", "env"])),
    ("log_query", obj({"service": s(), "level": enum("debug", "info", "warn", "error"), "since": s(format="date-time"),
                       "contains": nullable(s()), "limit": i(minimum=1, maximum=1000), "ip": nullable(s(format="ipv4"))},
                      req=["service", "since"])),
    ("tree", {"$defs": {"Node": obj({"name": s(), "size": i(minimum=0),
                                      "children": arr({"$ref": "#/$defs/Node"})}, req=["name"])},
              "$ref": "#/$defs/Node"}),
    ("pydantic_user", {"$defs": {"Address": {"properties": {"street": {"title": "Street", "type": "string"},
                                                             "city": {"title": "City", "type": "string"},
                                                             "postal_code": {"anyOf": [{"type": "string"},
                                                                                       {"type": "null"}],
                                                                             "default": None,
                                                                             "title": "Postal Code"}},
                                              "required": ["street", "city"], "title": "Address", "type": "object"},
                                  "Role": {"enum": ["admin", "editor", "viewer"], "title": "Role", "type": "string"}},
                       "properties": {"id": {"title": "Id", "type": "integer"},
                                      "name": {"title": "Name", "type": "string"},
                                      "email": {"format": "email", "title": "Email", "type": "string"},
                                      "roles": {"items": {"$ref": "#/$defs/Role"}, "title": "Roles", "type": "array"},
                                      "address": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}],
                                                  "default": None},
                                      "active": {"default": True, "title": "Active", "type": "boolean"}},
                       "required": ["id", "name", "email", "roles"], "title": "User", "type": "object"}),
    ("openai_strict", {"type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "object", "properties": {"explanation": {"type": "string"},
                                                                              "output": {"type": "string"}},
                                             "required": ["explanation", "output"], "additionalProperties": False}},
        "final_answer": {"type": "string"}}, "required": ["steps", "final_answer"], "additionalProperties": False}),
    ("ui_component", {"$defs": {"c": {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["div", "button", "header", "section", "field", "form"]},
        "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/c"}},
        "attributes": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                                   "value": {"type": "string"}},
                                                  "required": ["name", "value"], "additionalProperties": False}}},
        "required": ["type", "label", "children", "attributes"], "additionalProperties": False}},
        "$ref": "#/$defs/c"}),
    ("shape", {"oneOf": [obj({"kind": {"const": "circle"}, "radius": n(exclusiveMinimum=0)}),
                         obj({"kind": {"const": "rect"}, "w": n(exclusiveMinimum=0), "h": n(exclusiveMinimum=0)}),
                         obj({"kind": {"const": "polygon"}, "points": arr(arr(n(), minItems=2, maxItems=2), minItems=3)})]}),
    ("event_union", obj({"events": arr({"anyOf": [
        obj({"type": {"const": "click"}, "x": i(), "y": i()}),
        obj({"type": {"const": "key"}, "key": s(maxLength=16), "shift": b()}),
        obj({"type": {"const": "scroll"}, "dy": n()})]})})),
    ("semver_release", obj({"version": s(pattern="^(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?$"),
                            "date": s(format="date"), "notes": arr(s()), "breaking": b()})),
    ("survey", obj({"respondent": s(format="uuid"), "answers": arr(obj({"question": i(minimum=1, maximum=50),
                                                                       "choice": nullable(enum("a", "b", "c", "d")),
                                                                       "free_text": nullable(s(maxLength=500))}),
                                                                  minItems=1, maxItems=50),
                    "completed": b()}, req=["respondent", "answers"])),
    ("invoice", obj({"invoice_no": s(pattern="^INV-[0-9]{6}$"), "issued": s(format="date"), "due": s(format="date"),
                     "lines": arr(obj({"description": s(), "qty": i(minimum=1), "unit_price": n(minimum=0),
                                       "tax_rate": n(minimum=0, maximum=0.5)}), minItems=1),
                     "total": n(minimum=0), "paid": b()})),
    ("agent_handoff", obj({"to_agent": enum("researcher", "coder", "reviewer", "planner"), "reason": s(),
                           "context": {"type": "object", "properties": {"files": arr(s()), "notes": s()},
                                       "additionalProperties": True},
                           "priority": i(minimum=1, maximum=3)}, req=["to_agent", "reason"])),
    ("free_form", {"type": "object"}),
]

# ---- instances ---------------------------------------------------------------------------------


class Gen:
    def __init__(self, root, rng):
        self.root, self.rng = root, rng

    def resolve(self, ref):
        cur = self.root
        for t in ref[2:].split("/"):
            cur = cur[t]
        return cur

    def text(self, lo=1, hi=12):
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi))).capitalize()

    def string(self, sc):
        r = self.rng
        f = sc.get("format")
        if f == "email":
            return f"{r.choice(WORDS)}.{r.choice(WORDS)}@{r.choice(['example.com', 'mail.org', 'corp.io'])}"
        if f == "uri":
            return f"https://{r.choice(['example.com', 'docs.python.org', 'api.github.com'])}/{r.choice(WORDS)}?q={r.randint(1, 999)}"
        if f == "date":
            return f"20{r.randint(10, 35)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
        if f == "date-time":
            return f"20{r.randint(10, 35)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00Z"
        if f == "uuid":
            h = "%032x" % r.getrandbits(128)
            return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        if f == "ipv4":
            return ".".join(str(r.randint(0, 255)) for _ in range(4))
        if f == "json-pointer":
            return "/" + "/".join(r.choice(WORDS) for _ in range(r.randint(1, 3)))
        p = sc.get("pattern")
        if p:
            known = {"^[A-Z]{3}$": lambda: "".join(r.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(3)),
                     "^[a-z]{2}$": lambda: r.choice(["en", "fr", "de", "ja", "zh"]),
                     "^[0-9]{5}$": lambda: "%05d" % r.randint(0, 99999),
                     "^[0-9]{10}$": lambda: "%010d" % r.randint(0, 10 ** 10 - 1),
                     "^[A-Z]{2}-[0-9]{4}$": lambda: "%s-%04d" % (r.choice(["AB", "XY", "QQ"]), r.randint(0, 9999)),
                     "^C[0-9]{6}$": lambda: "C%06d" % r.randint(0, 999999),
                     "^INV-[0-9]{6}$": lambda: "INV-%06d" % r.randint(0, 999999),
                     "^[A-Z]{1,5}$": lambda: r.choice(["AAPL", "MSFT", "K", "NVDA"]),
                     "^[a-z0-9-]{1,63}$": lambda: r.choice(["default", "kube-system", "prod-eu-1"]),
                     "^[0-9+*/(). -]+$": lambda: "(%d + %d) * %d / 7" % (r.randint(1, 99), r.randint(1, 99), r.randint(1, 9)),
                     "^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$": lambda: r.choice(["octo/hello-world", "k3/engine", "a.b/c_d"]),
                     "^\\+?[0-9 -]{7,20}$": lambda: "+1 555-%04d" % r.randint(0, 9999)}
            if p in known:
                return known[p]()
            return "%d.%d.%d" % (r.randint(0, 9), r.randint(0, 30), r.randint(0, 99))
        mx = sc.get("maxLength", 400)
        mn = sc.get("minLength", 0)
        t = self.text(1, 30 if mx > 100 else 4)
        if r.random() < 0.15:
            t += ' — "quoted", tab\there, newline\nünïcödé 漢字 ✓'
        t = t[:mx]
        while len(t) < mn:
            t += "x"
        return t

    def number(self, sc, integer):
        r = self.rng
        lo = sc.get("minimum", sc.get("exclusiveMinimum", -1000 if not integer else -50))
        hi = sc.get("maximum", sc.get("exclusiveMaximum", 1000 if not integer else 5000))
        if integer:
            lo2 = lo + (1 if "exclusiveMinimum" in sc else 0)
            hi2 = hi - (1 if "exclusiveMaximum" in sc else 0)
            return r.randint(int(lo2), int(hi2))
        if sc.get("multipleOf") == 0.01:
            return round(r.uniform(max(lo, 0.01), hi), 2)
        v = round(r.uniform(lo, hi), r.choice([0, 1, 2, 3]))
        if "exclusiveMinimum" in sc and v <= lo:
            v = lo + 0.5
        return v

    def value(self, sc, depth=0):
        r = self.rng
        if "$ref" in sc:
            return self.value(self.resolve(sc["$ref"]), depth + 1)
        if "anyOf" in sc or "oneOf" in sc:
            br = sc.get("anyOf") or sc.get("oneOf")
            return self.value(r.choice(br), depth)
        if "const" in sc:
            return sc["const"]
        if "enum" in sc:
            return r.choice(sc["enum"])
        t = sc.get("type")
        if isinstance(t, list):
            t = r.choice(t)
        if t is None:
            t = r.choice(["string", "integer", "object", "array", "boolean"]) if depth < 3 else "string"
        if t == "string":
            return self.string(sc)
        if t == "integer":
            return self.number(sc, True)
        if t == "number":
            return self.number(sc, False)
        if t == "boolean":
            return r.random() < 0.5
        if t == "null":
            return None
        if t == "array":
            lo = sc.get("minItems", 0)
            hi = sc.get("maxItems", max(lo, 4 if depth < 2 else 1))
            k = r.randint(lo, min(hi, lo + (4 if depth < 3 else 0)))
            return [self.value(sc.get("items", {}), depth + 1) for _ in range(k)]
        if t == "object":
            out = {}
            props = sc.get("properties", {})
            req = set(sc.get("required", []))
            for k, v in props.items():
                if k in req or r.random() < 0.6:
                    out[k] = self.value(v, depth + 1)
            ap = sc.get("additionalProperties", True)
            if ap is not False and (not props or r.random() < 0.3) and depth < 3:
                for _ in range(r.randint(1, 3)):
                    out[r.choice(WORDS) + "_" + str(r.randint(1, 99))] = self.value(ap if isinstance(ap, dict) else {},
                                                                                  depth + 2)
            return out
        return None


def main():
    os.makedirs(OUT, exist_ok=True)
    for old in os.listdir(OUT):
        if old[:2].isdigit() and (old.endswith(".json") or old.endswith(".jsonl")):
            os.unlink(os.path.join(OUT, old))
    total = 0
    for k, (name, schema) in enumerate(SCHEMAS):
        rng = random.Random(1000 + k)
        v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
        g = Gen(schema, rng)
        lines = []
        tries = 0
        while len(lines) < 6 and tries < 200:
            tries += 1
            inst = g.value(schema)
            if not v.is_valid(inst):
                continue
            style = len(lines) % 3
            if style == 0:
                text = json.dumps(inst, ensure_ascii=False, separators=(",", ":"))
            elif style == 1:
                text = json.dumps(inst, ensure_ascii=False)
            else:
                text = json.dumps(inst, ensure_ascii=False, indent=2)
            lines.append(json.dumps(text, ensure_ascii=False))
        if len(lines) < 6:
            sys.exit(f"{name}: could not make valid instances")
        base = os.path.join(OUT, "%02d_%s" % (k + 1, name))
        with open(base + ".json", "w", encoding="utf-8") as f:
            json.dump(schema, f, ensure_ascii=False, indent=1)
            f.write("\n")
        with open(base + ".jsonl", "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        total += len(lines)
    print(f"{OUT}: {len(SCHEMAS)} schemas, {total} texts")


if __name__ == "__main__":
    main()
