"""The link between an exercise checker and the process that runs a learner's attempt.

    wire.py   what crosses: plain data (Encoder/Decoder), exceptions as data, length-prefixed JSON
    child.py  the attempt's process: imports the attempt, answers requests with observations
    link.py   the checker's side: `ex` in a task (RemoteRef), requests with deadlines, Link

The checker runs in the parent process, which never imports the attempt. A child process (forked from a server
that has torch imported) imports it and answers the parent's requests, one at a time:

    getattr  an attribute of the attempt's module (plain data comes back as a value, a function as a reference)
    setattr  put a value, or one of the checker's reference functions, in the attempt's module (reference_helpers)
    call     call the attempt's function with these arguments: what comes back is what it returned
    ranks    run one of its functions on real ranks (run_ranks) and return every rank's result
    grad     the gradient of an earlier call's outputs with respect to its inputs (loss.backward() in the checker)
    end      the task is over: forget its references and graphs

Every answer is an observation, serialised as plain data: None, bools, ints, floats, complex numbers, strings,
bytes, lists, tuples, dicts, sets, tensors and numpy arrays (dtype, shape and raw bytes), numpy scalars, a
torch.Generator's state, or an exception as its type name and text. The parent computes the reference answers,
compares and decides PASS or FAIL itself: an attempt that rewrites the checker's functions, patches torch.allclose,
returns an object whose __eq__ says True, or writes forged messages into the connection changes only what the
child says it observed. The parent reads the connection with a deadline and a size cap, parses JSON (never pickle)
and rebuilds only the types above; anything else is a broken protocol and the task FAILs.

Wire: each message is an 8-byte big-endian length, then that many bytes of UTF-8 JSON.
"""
