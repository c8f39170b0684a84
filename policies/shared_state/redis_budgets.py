"""Budgets shared by every replica: the same limits as `Budgets`, counted in Redis or Valkey.

Each operation is one Lua script (EVALSHA, EVAL when the server lost it), so a check and the
count it guards are atomic across replicas; scripts read the clock with `redis.call('TIME')`, so
replicas with skewed clocks agree on windows and days. Plain commands only: Redis >= 7 or Valkey,
no modules.

Keys, all of one tenant under the hash tag `{tenant}` (one cluster slot, so a script may touch
them all; the hold records name the scope keys they hold on, which the sweep reads back):

- `<prefix>{tenant}:<scope>:req` and `:tok`: requests and tokens per one-second bucket (a hash,
  buckets older than 60 s dropped by the scripts, the key expiring 120 s after its last write);
- `<prefix>{tenant}:<scope>:s`: today's and this month's spend (UTC) and the USD held;
- `<prefix>{tenant}:holds` and `:deadlines`: what each request in flight holds, and when that
  hold expires (a sorted set); every script first releases holds past their deadline, so a
  replica that dies mid-request leaks nothing for longer than `hold_ttl_s`. A charge renews it.

`<scope>` is `t` for the tenant and `a:<app>` for one of its apps.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from policies.budgets import WINDOW_S, Budgets, Limits
from policies.errors import BudgetExceeded, LimitExceeded
from policies.shared_state.outage_share import Left
from policies.shared_state.redis_mux import MuxClient

_LUA = resources.files("policies.shared_state") / "lua"


def _arg(value: float | None) -> str:
    return "" if value is None else repr(float(value))


class RedisBudgets:
    """The `BudgetStore` over one multiplexed connection (policies/shared_state/redis_mux.py: every request in
    flight shares its round trips); limits are resolved by the local `Budgets`."""

    def __init__(self, budgets: Budgets, client: MuxClient, *, key_prefix: str = "tierlane:", hold_ttl_s: float = 900.0) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("state.key_prefix must not contain { or }: the tenant is the hash tag")
        self.budgets = budgets
        self.client = client
        self._prefix = key_prefix
        self._ttl = repr(float(hold_ttl_s))
        prelude = (_LUA / "common.lua").read_text("utf-8")
        self._admit = client.script(prelude + (_LUA / "admit.lua").read_text("utf-8"))
        self._charge = client.script(prelude + (_LUA / "charge.lua").read_text("utf-8"))
        self._settle = client.script(prelude + (_LUA / "settle.lua").read_text("utf-8"))
        self._reconcile = client.script(
            prelude + (_LUA / "reconcile.lua").read_text("utf-8") + (_LUA / "settle.lua").read_text("utf-8")
        )
        self._heartbeat = client.script((_LUA / "heartbeat.lua").read_text("utf-8"))  # no tenant keys: no prelude

    @classmethod
    def connect(
        cls, budgets: Budgets, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float, hold_ttl_s: float
    ) -> RedisBudgets:
        """A client that connects lazily and reconnects on its own after the server comes back.

        Every call is bounded by the caller (`op_timeout_s` in SharedBudgets); a connection whose
        oldest command waited ten times that long is reopened.
        """
        client = MuxClient(url, connect_timeout_s=connect_timeout_s, stale_after_s=max(1.0, 10 * op_timeout_s))
        return cls(budgets, client, key_prefix=key_prefix, hold_ttl_s=hold_ttl_s)

    def _scopes(self, tenant: str, app: str) -> tuple[list[str], list[str], list[str]]:
        """(keys, limit arguments, who) for each scope of this caller that has limits."""
        tenant_limits, app_limits = self.budgets.limits(tenant, app)
        base = f"{self._prefix}{{{tenant}}}:"
        keys, args, who = [base + "holds", base + "deadlines"], [], []
        for scope, limits, name in (
            ("t", tenant_limits, f"tenant {tenant!r}"),
            (f"a:{app}", app_limits, f"app {app!r} of tenant {tenant!r}"),
        ):
            if limits.unlimited:
                continue
            keys += [f"{base}{scope}:req", f"{base}{scope}:tok", f"{base}{scope}:s"]
            args += [_arg(limits.requests_per_minute), _arg(limits.tokens_per_minute),
                     _arg(limits.daily_spend_usd), _arg(limits.monthly_spend_usd)]  # fmt: skip
            who.append(name)
        return keys, args, who

    def limited(self, tenant: str, app: str) -> bool:
        """Whether any limit applies to this caller (else nothing is counted, and Redis is not asked)."""
        tenant_limits, app_limits = self.budgets.limits(tenant, app)
        return not (tenant_limits.unlimited and app_limits.unlimited)

    async def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float) -> list[Left]:
        """What is left of each limited scope (tenant first, then app) after this request."""
        keys, args, who = self._scopes(tenant, app)
        if len(who) == 0:
            return []
        reply = await self._admit(keys=keys, args=[key, tokens, repr(max(0.0, reserve_usd)), self._ttl, *args])
        error = self._error(reply, who, tenant, app, admission=True, tokens=tokens)
        if error is not None:
            raise error
        values = [None if _text(v) == "" else float(_text(v)) for v in reply[1:]]
        return [tuple(values[i : i + 4]) for i in range(0, len(values), 4)]  # type: ignore[misc]

    def scope_keys(self, tenant: str, app: str) -> list[str]:
        """The limited scopes of this caller, as `admit` lists what is left of them."""
        tenant_limits, app_limits = self.budgets.limits(tenant, app)
        return [name for name, limits in ((tenant, tenant_limits), (f"{tenant}/{app}", app_limits)) if not limits.unlimited]

    async def reconcile(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> None:
        """Counts a request this replica admitted alone during an outage, once (policies/shared_state/lua/reconcile.lua)."""
        keys, _, who = self._scopes(tenant, app)
        if len(who) == 0:
            return
        await self._reconcile(keys=keys, args=[key, tokens, repr(max(0.0, cost))])

    async def heartbeat(self, replica: str, alive_s: float, epoch: str) -> tuple[int, str]:
        """(replicas alive, the store's epoch before this beat: '' when its data was lost)."""
        fleet = f"{self._prefix}{{_fleet}}:"
        reply = await self._heartbeat(keys=[fleet + "replicas", fleet + "epoch"], args=[replica, repr(float(alive_s)), epoch])
        return int(reply[0]), _text(reply[1])

    async def charge(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> LimitExceeded | None:
        keys, args, who = self._scopes(tenant, app)
        if len(who) == 0 or (tokens <= 0 and cost <= 0.0):
            return None
        reply = await self._charge(keys=keys, args=[key, tokens, repr(max(0.0, cost)), self._ttl, *args])
        return self._error(reply, who, tenant, app, admission=False, tokens=tokens)

    async def settle(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> None:
        keys, _, who = self._scopes(tenant, app)
        if len(who) == 0:
            return
        await self._settle(keys=keys, args=[key, tokens, repr(max(0.0, cost))])

    async def close(self) -> None:
        await self.client.close()

    def _error(self, reply: Any, who: list[str], tenant: str, app: str, *, admission: bool, tokens: int) -> LimitExceeded | None:
        """The refusal a script replied with ({kind, scope index, retry after, held}), as the local budgets word it."""
        kind = _text(reply[0])
        if kind == "ok":
            return None
        name, retry = who[int(reply[1]) - 1], float(_text(reply[2]))
        limits: Limits = self.budgets.limits(tenant, app)[0 if name.startswith("tenant") else 1]
        if kind == "rpm":
            return LimitExceeded(
                f"rate limit reached for {name}: {limits.requests_per_minute} requests per minute", retry_after=retry
            )
        if kind == "tpm_big":
            return LimitExceeded(
                f"this request (about {tokens} tokens) is larger than the limit of {name}: "
                f"{limits.tokens_per_minute} tokens per minute",
                code="tokens_exceed_limit",
                retry_after=WINDOW_S,
            )
        if kind == "tpm":
            if admission:
                return LimitExceeded(
                    f"rate limit reached for {name}: {limits.tokens_per_minute} tokens per minute", retry_after=retry
                )
            return LimitExceeded(
                f"stream stopped: {name} passed its limit of {limits.tokens_per_minute} tokens per minute", retry_after=retry
            )
        if kind == "day":
            if admission:
                held = " (with what requests in flight have reserved)" if _text(reply[3]) == "1" else ""
                return BudgetExceeded(
                    f"daily spend budget of ${limits.daily_spend_usd:.2f} reached for {name}{held}", retry_after=retry
                )
            return BudgetExceeded(
                f"stream stopped: {name} passed its daily spend budget of ${limits.daily_spend_usd:.2f}", retry_after=retry
            )
        if admission:
            return BudgetExceeded(
                f"monthly spend budget of ${limits.monthly_spend_usd:.2f} reached for {name}", retry_after=retry
            )
        return BudgetExceeded(
            f"stream stopped: {name} passed its monthly spend budget of ${limits.monthly_spend_usd:.2f}", retry_after=retry
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
