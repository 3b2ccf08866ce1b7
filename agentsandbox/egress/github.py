"""GitHub scopes: which repositories, and which writes, the injected GitHub token may reach.

Sans-IO and stdlib only.  With ``github.repos`` set, ``GitHubScope.decide``
classifies a request to GitHub's injected hosts (method, origin-form path and,
for GraphQL, the body) and says whether it may carry the token:

github.com (git's smart HTTP and LFS)
    any path of two or more segments names the repository ``/OWNER/NAME``
    (``.git`` stripped): ``info/refs`` (fetch and push both start there),
    ``git-upload-pack`` (fetch, clone), ``git-receive-pack`` (push),
    ``info/lfs/...``; it must be listed.  A shorter path may be read (GET,
    HEAD); anything else there is a user-level write.
api.github.com, uploads.github.com (REST)
    ``/repos/OWNER/NAME/...`` names that repository: it must be listed,
    for reads too.  ``/repositories/ID/...`` names one by number, which
    cannot be checked: refused.  ``/gists...`` may be read; creating,
    editing, starring or deleting a gist is refused.  ``POST /graphql`` is
    decided on its body (below).  Any other path may be read (GET, HEAD,
    OPTIONS); any other method there is a user-level write (``POST
    /user/repos``, ``PATCH /user``, ``PUT /user/starred/...``,
    ``POST /orgs/ORG/repos``, ``POST /markdown``), refused.
GraphQL (``POST /graphql``, its JSON body)
    a mutation's every root field must be listed in ``github.mutations``
    (``createPullRequest``, ``addComment``); a query's every
    ``repository(owner:, name:)`` must name a listed repository (literal
    arguments or the request's variables); a subscription, a batch, a
    fragment spread at a mutation's root, or a body that does not parse is
    refused.

Request rules (``github.requests``) are matched first and can allow any of
these; ``reqrules.py`` runs this only for a request no rule matched.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: Methods that only read.
READS = frozenset({b"GET", b"HEAD", b"OPTIONS"})
#: The largest GraphQL body held back to be read before it is forwarded.
MAX_GRAPHQL_BODY = 1024 * 1024

_GITHUB = "github.com"


@dataclass(frozen=True, slots=True)
class Verdict:
    """A scope's answer: allowed, refused (with why), or decided on the body."""

    allowed: bool
    why: str = ""
    needsBody: bool = False


ALLOWED = Verdict(True)
NEEDS_BODY = Verdict(False, needsBody=True)


class GitHubScope:
    """``github.repos`` (``owner/name`` or ``owner/*``) and ``github.mutations`` for one host."""

    __slots__ = ("_mutations", "_owners", "_repos", "host")

    def __init__(self, host: str, repos: tuple[str, ...], mutations: tuple[str, ...]) -> None:
        self.host = host
        self._repos = frozenset(r.lower() for r in repos if not r.endswith("/*"))
        self._owners = frozenset(r[:-2].lower() for r in repos if r.endswith("/*"))
        self._mutations = frozenset(mutations)

    def listed(self, owner: str, name: str) -> bool:
        owner = owner.lower()
        return owner in self._owners or f"{owner}/{name.lower()}" in self._repos

    def _repo(self, owner: bytes, name: bytes, what: str) -> Verdict:
        o, n = owner.decode("ascii", "replace"), name.decode("ascii", "replace")
        if self.listed(o, n):
            return ALLOWED
        return Verdict(False, f"{what} names the repository {o}/{n}, which github.repos does not list")

    def decide(self, method: bytes, path: bytes) -> Verdict:
        """The verdict on ``method path`` (a path without query, checked unambiguous)."""
        segments = path.split(b"/")[1:]
        if self.host == _GITHUB:
            if len(segments) >= 2 and segments[1]:
                name = segments[1][:-4] if segments[1].lower().endswith(b".git") else segments[1]
                return self._repo(segments[0], name, "git's smart HTTP (or the web) on github.com")
            return ALLOWED if method in READS else self._userWrite(method, path)
        first = segments[0].lower() if segments else b""
        if first == b"repos":
            if len(segments) < 3 or not segments[2]:
                return ALLOWED if method in READS else self._userWrite(method, path)
            return self._repo(segments[1], segments[2], "the call")
        if first == b"repositories" and len(segments) >= 2:
            return Verdict(False, "the call names a repository by its number, which github.repos cannot check")
        if first == b"graphql" and len(segments) == 1:
            return NEEDS_BODY if method == b"POST" else ALLOWED
        if method in READS:
            return ALLOWED
        if first == b"gists":
            return Verdict(False, "it creates, changes or deletes a gist, which github.repos never allows")
        return self._userWrite(method, path)

    def _userWrite(self, method: bytes, path: bytes) -> Verdict:
        return Verdict(False, "it writes without naming a repository (a user-level write), which github.repos never allows")

    def decideBody(self, body: bytes) -> Verdict:
        """The verdict on a GraphQL request's JSON body."""
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return Verdict(False, "its GraphQL body is not JSON")
        if not isinstance(request, dict) or not isinstance(request.get("query"), str):
            return Verdict(False, "its GraphQL body is not one {\"query\": ...} request (a batch is refused)")
        variables = request.get("variables") or {}
        if not isinstance(variables, dict):
            return Verdict(False, "its GraphQL variables are not an object")
        try:
            operations = graphqlOperations(request["query"])
        except ValueError as e:
            return Verdict(False, f"its GraphQL document cannot be read ({e})")
        for kind, fields in operations:
            if kind == "subscription":
                return Verdict(False, "a GraphQL subscription")
            if kind == "mutation":
                unlisted = [f for f in fields if f not in self._mutations]
                if unlisted:
                    return Verdict(
                        False, f"the GraphQL mutation {', '.join(unlisted)} is not listed in github.mutations"
                    )
        for owner, name in repositoryArguments(request["query"], variables):
            if owner is None or name is None:
                return Verdict(False, "a GraphQL repository(...) whose owner and name cannot be read")
            if not self.listed(owner, name):
                return Verdict(False, f"the GraphQL query names the repository {owner}/{name}, which github.repos does not list")
        return ALLOWED


# ---------------------------------------------------------------------- GraphQL, read just enough

_TOKEN = re.compile(
    r'"""(?:[^"\\]|\\.|"(?!""))*"""'  # block string
    r'|"(?:[^"\\\n]|\\.)*"'  # string
    r"|#[^\n]*"  # comment
    r"|\.\.\."  # spread
    r"|[A-Za-z_][A-Za-z0-9_]*"  # name
    r"|\$[A-Za-z_][A-Za-z0-9_]*"  # variable
    r"|-?[0-9][0-9.eE+-]*"  # number
    r"|[!():=@\[\]{}|&,]"  # punctuators
    r"|[ \t\r\n\ufeff]+"  # ignored
)


def _tokens(document: str) -> list[str]:
    out: list[str] = []
    at = 0
    while at < len(document):
        m = _TOKEN.match(document, at)
        if m is None:
            raise ValueError(f"an unexpected character at offset {at}")
        text = m.group()
        at = m.end()
        if text[0] in " \t\r\n\ufeff#,":
            continue
        out.append(text)
    return out


def graphqlOperations(document: str) -> list[tuple[str, tuple[str, ...]]]:
    """Each operation of ``document`` (fragments skipped): its kind and root fields."""
    tokens = _tokens(document)
    operations: list[tuple[str, tuple[str, ...]]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "{":
            kind = "query"
        elif token in ("query", "mutation", "subscription", "fragment"):
            kind = token
            while i < len(tokens) and tokens[i] != "{":  # name, variables, directives
                if tokens[i] == "(":
                    i = _skipParens(tokens, i)
                else:
                    i += 1
        else:
            raise ValueError(f"{token!r} where an operation starts")
        if i >= len(tokens):
            raise ValueError("an operation without a selection")
        fields, i = _rootFields(tokens, i)
        if kind != "fragment":
            operations.append((kind, fields))
    if not operations:
        raise ValueError("no operation")
    return operations


def _skipParens(tokens: list[str], i: int) -> int:
    depth = 0
    while i < len(tokens):
        if tokens[i] == "(":
            depth += 1
        elif tokens[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("unbalanced parentheses")


def _rootFields(tokens: list[str], i: int) -> tuple[tuple[str, ...], int]:
    """The root fields of the selection set opening at ``tokens[i]``; the index after it."""
    assert tokens[i] == "{"
    fields: list[str] = []
    depth = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "(":
            i = _skipParens(tokens, i)
            continue
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth == 0:
                return tuple(fields), i + 1
        elif depth == 1:
            if token == "...":
                raise ValueError("a fragment at an operation's root")
            if token == "@":
                i += 2  # a directive and its name
                continue
            if token[0].isalpha() or token[0] == "_":
                if i + 1 < len(tokens) and tokens[i + 1] == ":":  # an alias
                    i += 2
                    token = tokens[i]
                fields.append(token)
        i += 1
    raise ValueError("unbalanced braces")


_REPOSITORY = re.compile(r"\brepository\s*\(")
_ARGUMENT = re.compile(r'\b(owner|name)\s*:\s*(?:"((?:[^"\\]|\\.)*)"|\$([A-Za-z_][A-Za-z0-9_]*))')


def repositoryArguments(document: str, variables: dict[str, Any]) -> list[tuple[str | None, str | None]]:
    """(owner, name) of every ``repository(...)`` in ``document``, None where unreadable."""
    found: list[tuple[str | None, str | None]] = []
    for m in _REPOSITORY.finditer(document):
        close = document.find(")", m.end())
        if close < 0:
            found.append((None, None))
            continue
        values: dict[str, str | None] = {"owner": None, "name": None}
        for arg in _ARGUMENT.finditer(document, m.end(), close):
            literal, variable = arg.group(2), arg.group(3)
            value = literal if literal is not None else variables.get(variable or "")
            values[arg.group(1)] = value if isinstance(value, str) else None
        found.append((values["owner"], values["name"]))
    return found
