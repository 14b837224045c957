"""add_sub through Business Logic Scripting, written against Triton's python backend API.

Each request of the batch becomes one BLS request to the ONNX model ``add_sub``; all of them are
in flight at once (``async_exec``). meshserve sends them through the gateway (the python service's
``--bls-target``), so the called model may be of any kind and on any replica. A failed call's
error becomes that request's error, with its code.
"""
import asyncio

import triton_python_backend_utils as pb_utils

TARGET = "add_sub"
INPUTS = ("INPUT0", "INPUT1")
OUTPUTS = ("OUTPUT0", "OUTPUT1")


class TritonPythonModel:
    async def execute(self, requests):
        calls = [
            pb_utils.InferenceRequest(
                model_name=TARGET,
                requested_output_names=list(OUTPUTS),
                inputs=[pb_utils.get_input_tensor_by_name(request, name) for name in INPUTS],
            ).async_exec()
            for request in requests
        ]
        responses = []
        for result in await asyncio.gather(*calls):
            if result.has_error():
                responses.append(pb_utils.InferenceResponse(error=result.error()))
            else:
                outputs = [pb_utils.get_output_tensor_by_name(result, name) for name in OUTPUTS]
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
