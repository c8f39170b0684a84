"""Where budgets are counted: the small interface both the in-process and the shared store implement.

The in-process `Budgets` (policies/budgets.py) is the embedded default and stays synchronous;
`LocalStore` puts it behind the same async interface as `RedisBudgets` (policies/redis_budgets.py),
so `SharedBudgets` (policies/shared_budgets.py) can fall back from one to the other.
"""

from __future__ import annotations

from typing import Protocol

from policies.budgets import Budgets
from policies.errors import LimitExceeded


class BudgetStore(Protocol):
    """Admit with a reservation, charge streams, settle at the end; the same semantics as `Budgets`."""

    async def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float) -> None:
        """Count the request and hold `reserve_usd`, or raise LimitExceeded / BudgetExceeded without counting."""
        ...

    async def charge(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> LimitExceeded | None:
        """Charge tokens a stream produced; the error to end it with when it is now over a limit."""
        ...

    async def settle(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> None:
        """Replace what the request held and was charged so far by its final tokens and cost."""
        ...

    async def close(self) -> None: ...


class LocalStore:
    """The in-process budgets behind the store interface (no await ever suspends)."""

    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets

    async def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float) -> None:
        self.budgets.admit(key, tenant, app, tokens, reserve_usd)

    async def charge(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> LimitExceeded | None:
        return self.budgets.stream_breach(key, tokens, cost)

    async def settle(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> None:
        self.budgets.settle(key, tokens, cost)

    async def close(self) -> None:
        return None
