"""The scheduler service: every decision about which requests run, how many of their tokens, and which
physical KV block ids they own.

The pure scheduling core (no gRPC, no tensors, no asyncio) is split by owner of state:

* ``request``: one request's tokens and progress counters.
* ``block_pool``: physical GPU blocks, their reference counts, the free queue (which doubles as the
  LRU of cached free blocks) and the prefix-cache hash map.
* ``kv_cache_manager``: each request's block table on top of the pool, prefix-cache lookups, and the
  CPU swap pool.
* ``core``: the ``Scheduler``, which owns the queues and the policy (budget, priorities, preemption)
  and emits one ``StepPlan`` per step, mapping one to one onto ``pagedserve.v1.StepPlan``.

Around the core, the service side (asyncio, gRPC):

* ``discovery``: ``--executor`` addresses (``host:port``, ``dns:///name:port``), parsed and resolved.
* ``router``: which executor a request goes to (exact prefix-cache hit against load; pure).
* ``replica``: one executor's transport, lease, core and Step loop.
* ``engine``: the request table, placement, failover and the clients' streams, over all replicas.
* ``service``: the public gRPC API (Generation, Admin).
"""
