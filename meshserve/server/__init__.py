"""Protocol front ends shared by the gateway and every service.

Both processes implement `V2Core`; the gRPC and HTTP front ends here only translate the
wire format and map errors (STYLE.md lesson 1).
"""
