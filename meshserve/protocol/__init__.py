"""Protocol vocabulary shared by gateway and services: datatypes, tensors, errors, HTTP codec."""
