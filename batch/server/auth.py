"""Who a request is: API keys checked in constant time, and the fairness identity the server gives.

The fairness identity (the scheduler's ``user_id``) is the server's, never the client's word,
except where the operator says the client's word is trusted. ``Identities`` holds the rule, one of
four modes, chosen at start-up (``batch-llm serve``'s flags):

* **keys** (the config lists ``api_keys``): every ``/v1`` request needs ``Authorization: Bearer
  KEY`` with a listed key, else 401; the identity is the key's user. The body's ``user`` never
  changes it, so a key's holder has one fair share however it names its requests.
* **user header** (``--user-header NAME``, no keys): the identity is that header's value, set by a
  trusted gateway in front (Envoy-based gateways pass the tenant this way); without the header,
  the shared identity ``anonymous``. Only safe when clients cannot reach the server but through
  the gateway, which must overwrite the header.
* **user field** (``--trust-user-field``, no keys): the body's ``user`` (else ``anonymous``), for a
  trusted front end that sets it; a client that can reach the server can claim any identity.
* **shared** (none of them): every request is ``anonymous``: one fair share for all, which no
  client can escape by naming itself.

A presented key is hashed (SHA-256) and its digest looked up in a hash table of the configured
keys' digests (``KeyRing``): O(1) whatever the number of keys (the scan over every key it replaces
grew with them). The time taken tells nothing useful of the key: what a lookup
compares is a digest of the attacker's own input, so learning where a digest differs from a stored
one (which slot it probes, where a comparison stops) is learning nothing about any key, whose
digest cannot be inverted. Only the digests are kept, not the keys. Keys are never logged, put in
an error message or exported (the identity is the user name the config maps the key to). Standard
library only.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Mapping

__all__ = ["ANONYMOUS", "MAX_USER_CHARS", "AuthError", "Identities", "KeyRing", "bearer_key"]

#: The identity shared by every request the server cannot tell apart.
ANONYMOUS = "anonymous"
#: Longest identity taken from a client's ``user`` field or a gateway's header (characters); a
#: longer one is a 400 (each identity the scheduler sees holds state until it is forgotten).
MAX_USER_CHARS = 256


class AuthError(ValueError):
    """A request the identity rule refuses: 401 (no valid key) or 400 (a bad user value).

    Attributes:
        status: 401 or 400.
        message: what is wrong (never the key).
        code: OpenAI's error code (``"invalid_api_key"`` for a 401, else the status).
        param: the offending field (``"user"``) or ``None``.
    """

    def __init__(self, status: int, message: str, code: str | int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = status if code is None else code


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or ``None`` (no header, another scheme
    such as ``Basic``, or an empty key). ``headers`` is case-insensitive (Starlette's)."""
    auth = headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def _digest(key: str) -> bytes:
    # HTTP header values are Latin-1 (Starlette decodes them so); any str encodes this way or as UTF-8
    try:
        raw = key.encode("latin-1")
    except UnicodeEncodeError:
        raw = key.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).digest()


class KeyRing:
    """API key -> user, looked up in O(1) on the key's SHA-256 digest.

    A hash table of its own, compact and outside Python's small-object heap: the digests in one
    ``bytearray`` (32 bytes a slot), each slot's user number in an ``array`` (4 bytes; -1 empty),
    at most half the slots used (linear probing from the digest's first 8 bytes: about 1.5 slots
    compared on a hit, 2.5 on a miss); the distinct user names UTF-8 in one ``bytes`` with their
    offsets. At 100,000 keys: 262,144 slots of 36 bytes, 94 bytes a key, plus the names; a ``dict``
    of ``bytes`` digests would cost a small object and a slot a key, and its small objects, made
    while the config's parse is alive, keep the parse's freed memory from going back to the OS.
    The keys themselves are not kept.

    Args:
        api_keys: key -> user name (non-empty strings), or a ``KeyRing`` (shared as it is).

    Raises:
        ValueError: a key or user that is not a non-empty string.
    """

    __slots__ = ("_mask", "_digests", "_users", "_names", "_offsets", "_n")

    def __init__(self, api_keys: "Mapping[str, str] | KeyRing") -> None:
        if isinstance(api_keys, KeyRing):
            for a in KeyRing.__slots__:
                setattr(self, a, getattr(api_keys, a))
            return
        size = 8
        while size < 2 * len(api_keys):
            size *= 2
        self._mask = size - 1
        self._digests = bytearray(32 * size)
        self._users = array("i", [-1]) * size
        self._n = 0
        numbers: dict[str, int] = {}  # user -> its number (names stored once; dropped after the build)
        names, offsets = bytearray(), array("I", [0])
        for k, u in api_keys.items():
            if not (isinstance(k, str) and k and isinstance(u, str) and u):
                raise ValueError("api_keys: every key and user must be a non-empty string")
            number = numbers.setdefault(u, len(numbers))
            if number == len(offsets) - 1:  # a new user: its name goes to the blob
                names += u.encode("utf-8", "surrogatepass")
                offsets.append(len(names))
            self._put(_digest(k), number)
        self._names, self._offsets = bytes(names), offsets

    def _slot(self, d: bytes) -> int:
        """The slot holding digest ``d``, or the empty slot where it would go."""
        mask, digests, users = self._mask, self._digests, self._users
        i = int.from_bytes(d[:8], "little") & mask
        while users[i] >= 0 and digests[32 * i:32 * i + 32] != d:
            i = (i + 1) & mask
        return i

    def _put(self, d: bytes, user: int) -> None:
        i = self._slot(d)
        if self._users[i] < 0:
            self._n += 1
        self._digests[32 * i:32 * i + 32] = d
        self._users[i] = user

    def _name(self, number: int) -> str:
        return self._names[self._offsets[number]:self._offsets[number + 1]].decode("utf-8", "surrogatepass")

    def __len__(self) -> int:
        return self._n

    def users(self) -> set[str]:
        """The distinct users the keys name."""
        return {self._name(n) for n in range(len(self._offsets) - 1)}

    def user_of(self, key: str | None) -> str | None:
        """The user of ``key``, or ``None`` when it is not a configured key (or is ``None``)."""
        if key is None:
            return None
        number = self._users[self._slot(_digest(key))]
        return None if number < 0 else self._name(number)


class Identities:
    """The server's rule for who a request is (module doc).

    Args:
        api_keys: key -> user (or a ``KeyRing``); non-empty turns authentication on.
        trust_user_field: without keys, take the body's ``user``.
        user_header: without keys, take this header's value (a trusted gateway's).

    Raises:
        ValueError: ``trust_user_field`` or ``user_header`` together with keys (with keys the
            key alone decides), both together, a ``user_header`` that is not a valid header
            name, or what ``KeyRing`` refuses.
    """

    def __init__(self, api_keys: "Mapping[str, str] | KeyRing | None" = None, *, trust_user_field: bool = False,
                 user_header: str | None = None) -> None:
        self.keys = KeyRing(api_keys or {})
        if self.keys and trust_user_field:
            raise ValueError("--trust-user-field cannot be used with api_keys: with keys, the key's user is the "
                             "identity and the body's 'user' never changes it")
        if self.keys and user_header:
            raise ValueError("--user-header cannot be used with api_keys: with keys, the key's user is the identity")
        if trust_user_field and user_header:
            raise ValueError("--trust-user-field and --user-header cannot be used together: pick one source of "
                             "identity")
        if user_header is not None and (not user_header or not all(
                c.isascii() and (c.isalnum() or c in "-_") for c in user_header)):
            raise ValueError(f"--user-header must be a header name (letters, digits, '-', '_'), got {user_header!r}")
        self.trust_user_field = trust_user_field
        self.user_header = user_header.lower() if user_header else None

    @property
    def required(self) -> bool:
        """Whether requests need a valid key (keys are configured)."""
        return bool(self.keys)

    @property
    def mode(self) -> str:
        """``"keys"``, ``"user-header"``, ``"user-field"`` or ``"shared"``."""
        if self.keys:
            return "keys"
        if self.user_header:
            return "user-header"
        return "user-field" if self.trust_user_field else "shared"

    def check_key(self, headers: Mapping[str, str]) -> str:
        """The user of the request's bearer key.

        Raises:
            AuthError: 401 ``invalid_api_key``: no key, another scheme, or a key not configured.
        """
        key = bearer_key(headers)
        user = self.keys.user_of(key)
        if user is None:
            if key is None:
                raise AuthError(401, "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.",
                                code="invalid_api_key")
            raise AuthError(401, "Incorrect API key provided.", code="invalid_api_key")
        return user

    def authenticate(self, headers: Mapping[str, str]) -> str | None:
        """Before the body is read: the identity the headers give, or ``None`` when the body's
        ``user`` decides (``trust_user_field``).

        Raises:
            AuthError: 401 (keys mode, no valid key); 400 for a gateway header over
                ``MAX_USER_CHARS``.
        """
        if self.keys:
            return self.check_key(headers)
        if self.user_header:
            value = headers.get(self.user_header, "").strip()
            if len(value) > MAX_USER_CHARS:
                raise AuthError(400, f"header {self.user_header}: longer than {MAX_USER_CHARS} characters")
            return value or ANONYMOUS
        return None if self.trust_user_field else ANONYMOUS

    def user(self, principal: str | None, body_user: str | None) -> str:
        """The fairness identity: ``principal`` (``authenticate``'s) when it decided, else the
        body's ``user`` (trusted), else ``anonymous``.

        Raises:
            AuthError: 400 naming ``user`` for a trusted ``user`` over ``MAX_USER_CHARS``.
        """
        if principal is not None:
            return principal
        if body_user is not None and len(body_user) > MAX_USER_CHARS:
            raise AuthError(400, f"user: longer than {MAX_USER_CHARS} characters", param="user")
        return body_user or ANONYMOUS
