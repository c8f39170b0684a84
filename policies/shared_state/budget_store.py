"""Where budgets are counted across replicas: the small interface `SharedBudgets` talks to.

`RedisBudgets` (policies/shared_state/redis_budgets.py) implements it over Redis/Valkey; the in-process
`Budgets` (policies/budgets.py) is the embedded default and the `allow` outage fallback.
"""

from __future__ import annotations

from typing import Protocol

from policies.errors import LimitExceeded
from policies.shared_state.outage_share import Left


class BudgetStore(Protocol):
    """Admit with a reservation, charge streams, settle at the end; the same semantics as `Budgets`."""

    async def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float) -> list[Left]:
        """Count the request and hold `reserve_usd`, or raise LimitExceeded / BudgetExceeded without counting.

        Returns what is left of each limited scope after it (`scope_keys` order)."""
        ...

    def scope_keys(self, tenant: str, app: str) -> list[str]:
        """The limited scopes of this caller, in the order `admit` reports them."""
        ...

    async def charge(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> LimitExceeded | None:
        """Charge tokens a stream produced; the error to end it with when it is now over a limit."""
        ...

    async def settle(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> None:
        """Replace what the request held and was charged so far by its final tokens and cost."""
        ...

    async def reconcile(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> None:
        """Count, once, a request a replica admitted alone while the store was unreachable."""
        ...

    async def heartbeat(self, replica: str, alive_s: float, epoch: str) -> tuple[int, str]:
        """(replicas alive, the store's data epoch before this beat, '' when it was missing)."""
        ...

    async def close(self) -> None: ...
