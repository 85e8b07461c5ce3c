"""The node agent: one process per node, beside the training processes, that moves snapshot bytes the
trainers no longer need to touch (``docs/agent.md``). It outlives the workers (a restarted or replacing
worker finds it through its pid file in the node-local store), runs niced, and reads the ranks' stores as
any other reader does. Today it writes the durable tier (``--ft-persist-agent``); the trainer only sends it
an iteration number per due snapshot."""
