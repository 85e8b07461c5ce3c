"""The node agent: one process per node, beside the training processes, that moves snapshot bytes the
trainers no longer need to touch (``docs/replication.md``, ``docs/store.md``). It outlives the workers (a restarted or replacing
worker finds it through its pid file in the node-local store), runs niced, and reads the ranks' stores as
any other reader does. It writes the durable tier (``--ft-persist-agent``), hashes published points
(``--ft-checksum-by agent``) and sends and receives the peer replicas (``--ft-replicate-by agent``); the
trainer only names iterations to it."""
