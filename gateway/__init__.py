"""tierlane gateway: the aiohttp proxy, its pipeline and the upstream pool."""

__version__ = "0.1.0"
