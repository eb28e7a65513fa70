"""The engine core: the step loop's bridge to asyncio, the scheduler, the KV cache manager and the memory plan."""
