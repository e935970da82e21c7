"""gRPC's C-core log lines kept off stderr: imported first by the package, before anything imports grpc.

grpcio 1.85 prints its INFO lines on stderr by default (`I1206 ... ssl_transport_security.cc ... Handshake failed`,
`fork_posix.cc ... skipping fork() handlers`). Unless the user set GRPC_VERBOSITY or asked for traces (GRPC_TRACE),
it runs at ERROR. grpc reads the variable when it is first imported, so it is set before that and taken out again
after: the processes this one starts do not inherit it (a tokenloop server's TLS log reads gRPC's INFO lines).
"""

import os

_QUIET = "GRPC_VERBOSITY" not in os.environ and not os.environ.get("GRPC_TRACE")
if _QUIET:
    os.environ["GRPC_VERBOSITY"] = "ERROR"
import grpc  # noqa: E402, F401  (reads GRPC_VERBOSITY now)

if _QUIET:
    del os.environ["GRPC_VERBOSITY"]
