"""Request rules on terminated hosts: which requests an injected credential may carry.

Sans-IO and stdlib only: ``RequestPolicy.decide(method, target)`` takes the
method and the origin-form target the origin will see (after the strict
grammar, ``http11.py``, and the tunnel's absolute-form rewrite) and says
which rule lets it through or refuses it.

The target is never normalised.  On a host with rules, a target whose meaning
an origin might read differently from this matcher is refused outright:

- dot segments (``/./``, ``/../``, a trailing ``/.`` or ``/..``);
- an empty segment (``//``), a backslash, a fragment (``#``), a ``;`` (path
  parameters, which some servers strip before routing);
- a percent-encoded ``.``, ``/``, ``\\`` or unreserved character (``%2e``,
  ``%2F``, ``%5c``, ``%67``): an origin that decodes before routing would see
  another path than the one matched (``/gist%73`` is ``/gists``), and RFC 3986
  says these are never to be encoded;
- a ``%`` not followed by two hex digits.

Matching is ASCII case-insensitive (origins such as GitHub route
``/REPOS/Owner/Name`` as ``/repos/owner/name``, so a refusal must not be
dodged by capitals); one trailing ``/`` is ignored (``/gists/`` is ``/gists``);
the query string is not part of the path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentsandbox.config import ALLOW, GITHUB_HOSTS, REFUSE, InjectRule, RequestRule
from agentsandbox.egress.github import GitHubScope

#: Headers that ask an origin to take the request as another method; a request
#: carrying one is refused on a host with rules (the rules match the method sent).
METHOD_OVERRIDES = frozenset({b"x-http-method-override", b"x-http-method", b"x-method-override"})

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEX = frozenset(b"0123456789abcdefABCDEF")
#: Any byte that makes a target ambiguous, found in one pass; the ``%`` hits are looked at one by one.
_SUSPECT = re.compile(rb"[\\#;%]|//|/\.\.?(?:/|$)")


def ambiguity(path: bytes) -> str | None:
    """Why ``path`` (a target's path, without the query) is ambiguous, or None."""
    if _SUSPECT.search(path) is None:  # (the common case: one C call)
        return None
    for m in _SUSPECT.finditer(path):
        found = m.group()
        if found == b"%":
            at = m.start()
            pair = path[at + 1 : at + 3]
            if len(pair) != 2 or pair[0] not in _HEX or pair[1] not in _HEX:
                return "a '%' not followed by two hex digits"
            byte = int(pair, 16)
            if byte in _UNRESERVED or byte in (0x2F, 0x5C):
                return f"a percent-encoded {chr(byte)!r} ({pair.decode('ascii')}), which an origin may decode before routing"
            continue
        if found == b"\\":
            return "a backslash"
        if found == b"#":
            return "a fragment ('#')"
        if found == b";":
            return "a ';' (path parameters)"
        if found == b"//":
            return "an empty segment ('//')"
        return "a dot segment ('.' or '..')"
    return None


def compilePattern(pattern: str) -> re.Pattern[bytes]:
    """A path pattern as a regular expression over the request's path (case-insensitive)."""
    out: list[str] = []
    for segment in pattern.split("/")[1:]:
        if segment == "**":
            out.append("(?:/[^/]*)*")
        else:
            out.append("/" + "[^/]*".join(re.escape(part) for part in segment.split("*")))
    body = "".join(out)
    return re.compile(body.encode("ascii"), re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Decision:
    """A request's fate: ``allowed``, the rule that decided (None: ``unmatched``) and why."""

    allowed: bool
    rule: RequestRule | None
    text: str  # for a refusal: the 403's text; names the rule and the key
    #: Not decided yet: the body (GraphQL's) decides, through ``decideBody``.
    needsBody: bool = False
    #: The key that decided, for the audit record.
    key: str = ""


class RequestPolicy:
    """The request rules of one inject rule, for one of its hosts."""

    __slots__ = ("_anyMethod", "_byMethod", "_host", "_rule", "_scope")

    def __init__(self, rule: InjectRule, host: str) -> None:
        self._rule = rule
        self._host = host
        self._scope = (
            GitHubScope(host, rule.repos, rule.mutations) if rule.repos is not None and host in GITHUB_HOSTS else None
        )
        compiled = [
            (r, compilePattern(r.path), frozenset(m.encode("ascii") for m in r.methods))
            for r in rule.requests
            if r.host in (None, host)
        ]
        # Per method named anywhere, the rules that can match it, in order, as
        # one alternation (its first matching branch is the first matching
        # rule, found in one call); any other method meets only the rules that
        # name none.
        named = {m for _, _, methods in compiled for m in methods}
        self._byMethod = {
            m: _alternation([(r, regex) for r, regex, methods in compiled if not methods or m in methods])
            for m in named
        }
        self._anyMethod = _alternation([(r, regex) for r, regex, methods in compiled if not methods])

    def decide(self, method: bytes, target: bytes, overridden: bool = False) -> Decision:
        """Which rule lets ``method target`` through or refuses it (first match wins)."""
        path = target.split(b"?", 1)[0]
        why = ambiguity(path)
        if why is not None or overridden:
            return self._ambiguous(method, path, why)
        if len(path) > 1 and path[-1:] == b"/":
            path = path[:-1]
        regex, rules = self._byMethod.get(method, self._anyMethod)
        found = regex.fullmatch(path) if regex is not None else None
        if found is not None:
            rule = rules[found.lastgroup or ""]
            if rule.action == ALLOW:
                return Decision(True, rule, "")
            return Decision(
                False,
                rule,
                f"{_shown(method, path)} to {self._host} is refused by {rule.key} ({rule.describe()}); "
                f"an allow rule before it in {self._rule.key}.requests would let it through",
                key=rule.key,
            )
        scope = self._scope
        if scope is not None:
            verdict = scope.decide(method, path)
            if verdict.needsBody:
                return Decision(False, None, "", needsBody=True)
            if not verdict.allowed:
                return self._outOfScope(method, path, verdict.why)
            return _ALLOWED
        if self._rule.unmatched == REFUSE:
            key = self._rule.key
            return Decision(
                False,
                None,
                f"{_shown(method, path)} to {self._host} matches no rule of {key}.requests and {key}.unmatched "
                f"is \"refuse\"; add an allow rule for it to {key}.requests",
                key=key + ".unmatched",
            )
        return _ALLOWED

    def decideBody(self, method: bytes, target: bytes, body: bytes) -> Decision:
        """The decision on a request ``decide`` left to its body (GraphQL's)."""
        assert self._scope is not None
        verdict = self._scope.decideBody(body)
        if verdict.allowed:
            return _ALLOWED
        return self._outOfScope(method, target.split(b"?", 1)[0], verdict.why)

    def _outOfScope(self, method: bytes, path: bytes, why: str) -> Decision:
        if "github.mutations" in why:
            key, fix = "github.mutations", "list the mutation in github.mutations"
        elif "github.repos does not list" in why:
            key, fix = "github.repos", "list the repository in github.repos, or add an allow rule for it to github.requests"
        else:
            key, fix = "github.requests", "add an allow rule for it to github.requests"
        return Decision(False, None, f"{_shown(method, path)} to {self._host} is refused: {why}; {fix}", key=key)

    def _ambiguous(self, method: bytes, path: bytes, why: str | None) -> Decision:
        shown = _shown(method, path)
        key = self._rule.key
        if why is not None:
            return Decision(
                False,
                None,
                f"{shown} to {self._host} is refused: its target holds {why}, which {key}.requests "
                "cannot match unambiguously (send the plain path)",
                key=key + ".requests",
            )
        return Decision(
            False,
            None,
            f"{shown} to {self._host} is refused: it asks for another method (X-HTTP-Method-Override), "
            f"which {key}.requests cannot match",
            key=key + ".requests",
        )


def _alternation(
    rules: list[tuple[RequestRule, re.Pattern[bytes]]],
) -> tuple[re.Pattern[bytes] | None, dict[str, RequestRule]]:
    """One pattern matching what any of ``rules`` matches; its ``lastgroup`` names the first that does."""
    if not rules:
        return None, {}
    names = {f"r{i}": rule for i, (rule, _) in enumerate(rules)}
    body = b"|".join(b"(?P<r%d>%b)" % (i, regex.pattern) for i, (_, regex) in enumerate(rules))
    return re.compile(body, re.IGNORECASE), names


def _shown(method: bytes, path: bytes) -> str:
    return f"{method.decode('ascii')} {path.decode('ascii', 'replace')}"


_ALLOWED = Decision(True, None, "")
