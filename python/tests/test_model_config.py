"""moe_ep_client.model_config and Group.from_model (issue 31 item 4) on the
published configs of ../shared/data/models (MOE_EP_DATA_DIR).

Each file's sizes are checked against the published values written out
below (the models' own numbers: DeepSeek-V3's first 3 layers are dense, so
58 of 61 are sparse), and, when MOE_EP_CLI names the moe-ep binary, against
the C++ reader through `moe-ep plan --model FILE --tp 1 --json`.
"""

import json
import os
import subprocess
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.environ.get("MOE_EP_DATA_DIR") or os.path.join(HERE, "..", "..", "..", "shared", "data")
MODELS = os.path.join(DATA, "models")
CLI = os.environ.get("MOE_EP_CLI", "")

# file stem: (model_type, hidden, layers, experts, top_k, moe_intermediate, dense layers)
PUBLISHED = {
    "DeepSeek-V3": ("deepseek_v3", 7168, 61, 256, 8, 2048, [0, 1, 2]),
    "DeepSeek-R1": ("deepseek_v3", 7168, 61, 256, 8, 2048, [0, 1, 2]),
    "DeepSeek-V2-Lite": ("deepseek_v2", 2048, 27, 64, 6, 1408, [0]),
    "Kimi-K2-Instruct": ("kimi_k2", 7168, 61, 384, 8, 2048, [0]),
    "Qwen3-30B-A3B": ("qwen3_moe", 2048, 48, 128, 8, 768, []),
    "Qwen3-235B-A22B": ("qwen3_moe", 4096, 94, 128, 8, 1536, []),
    "Qwen1.5-MoE-A2.7B.partial": ("qwen2_moe", 2048, 24, 60, 4, 1408, []),
    "Mixtral-8x7B-v0.1": ("mixtral", 4096, 32, 8, 2, 14336, []),
    "Mixtral-8x22B-v0.1": ("mixtral", 6144, 56, 8, 2, 16384, []),
    "gpt-oss-20b": ("gpt_oss", 2880, 24, 32, 4, 2880, []),
    "gpt-oss-120b": ("gpt_oss", 2880, 36, 128, 4, 2880, []),
    "MiniMax-M2.5": ("minimax_m2", 3072, 62, 256, 8, 1536, []),
    "Llama-4-Scout-17B-16E-Instruct": ("llama4", 5120, 48, 16, 1, 8192, []),
}


@unittest.skipUnless(os.path.isdir(MODELS), f"no model configs at {MODELS} (set MOE_EP_DATA_DIR)")
class PublishedConfigsTest(unittest.TestCase):
    def test_every_file_reads_as_published(self):
        from moe_ep_client import ModelConfig

        files = sorted(f for f in os.listdir(MODELS) if f.endswith(".json"))
        self.assertEqual(sorted(f[: -len(".json")] for f in files), sorted(PUBLISHED))
        for f in files:
            stem = f[: -len(".json")]
            m = ModelConfig.load(os.path.join(MODELS, f))
            mt, hidden, layers, experts, top_k, inter, dense = PUBLISHED[stem]
            got = (m.name, m.model_type, m.hidden_size, m.num_layers, m.num_experts, m.top_k,
                   m.moe_intermediate_size)
            self.assertEqual(got, (stem, mt, hidden, layers, experts, top_k, inter), f)
            self.assertEqual([i for i in range(layers) if i not in m.sparse_layer_indices()], dense, f)

    def test_dict_and_directory_forms(self):
        from moe_ep_client import ModelConfig

        path = os.path.join(MODELS, "DeepSeek-V3.json")
        with open(path) as f:
            raw = json.load(f)
        self.assertEqual(ModelConfig.load(raw, name="DeepSeek-V3"), ModelConfig.load(path))
        self.assertEqual(ModelConfig.load(raw).name, "deepseek_v3")  # a dict: its model_type

    def test_errors_name_the_key(self):
        from moe_ep_client import ModelConfig

        with open(os.path.join(MODELS, "Qwen3-30B-A3B.json")) as f:
            good = json.load(f)
        cases = [
            ({"model_type": "bert"}, "model config key 'model_type' is 'bert', not a supported MoE family"),
            ({**good, "hidden_size": "2048"}, "model config key 'hidden_size' must be an integer, got string \"2048\""),
            ({**good, "num_experts_per_tok": 200}, "top-k (num_experts_per_tok) 200 exceeds the number of routed experts 128"),
            ({**good, "n_routed_experts": 64}, "model config keys 'n_routed_experts' (64) and 'num_experts' (128) disagree"),
            ({k: v for k, v in good.items() if k != "moe_intermediate_size" and k != "intermediate_size"},
             "model config is missing required key 'intermediate_size'"),
            ({**good, "mlp_only_layers": list(range(48))}, "no sparse (MoE) layer among 48 layers"),
        ]
        for config, text in cases:
            with self.assertRaises(ValueError) as caught:
                ModelConfig.load(config)
            self.assertIn(text, str(caught.exception))
        with self.assertRaises(FileNotFoundError):
            ModelConfig.load(os.path.join(MODELS, "no-such-model.json"))
        with open(os.path.join(MODELS, "Llama-4-Scout-17B-16E-Instruct.json")) as f:
            llama = json.load(f)
        llama["text_config"]["num_local_experts"] = "16"
        with self.assertRaises(ValueError) as caught:
            ModelConfig.load(llama)
        self.assertIn("'text_config.num_local_experts' must be an integer", str(caught.exception))

    @unittest.skipUnless(CLI and os.path.exists(CLI), "MOE_EP_CLI not set")
    def test_same_as_the_cpp_reader(self):
        from moe_ep_client import ModelConfig

        for f in sorted(os.listdir(MODELS)):
            if not f.endswith(".json"):
                continue
            path = os.path.join(MODELS, f)
            out = subprocess.run([CLI, "plan", "--model", path, "--tp", "1", "--json"],
                                 check=True, capture_output=True, text=True).stdout
            plan = json.loads(out)
            m = ModelConfig.load(path)
            self.assertEqual(
                (m.name, m.model_type, m.hidden_size, m.num_layers, m.num_experts, m.top_k,
                 m.moe_intermediate_size),
                (plan["model"], plan["model_type"], plan["hidden_size"], plan["num_layers"],
                 plan["num_experts"], plan["top_k"], plan["moe_intermediate_size"]),
                f,
            )
            self.assertEqual(list(m.sparse_layers), [layer["sparse"] for layer in plan["layers"]], f)


@unittest.skipUnless(os.path.isdir(MODELS), f"no model configs at {MODELS} (set MOE_EP_DATA_DIR)")
class FromModelTest(unittest.TestCase):
    def test_sizes_default_to_the_model(self):
        from moe_ep_client import Group

        with Group.from_model(os.path.join(MODELS, "DeepSeek-V3.json"), ["127.0.0.1:1"]) as g:
            self.assertEqual(g.model.hidden_size, 7168)
            self.assertEqual(g._size("hidden_size", None, "hidden_size"), 7168)
            self.assertEqual(g._size("top_k", 4, "top_k"), 4)  # an explicit size wins
        with Group(["127.0.0.1:1"]) as g:
            with self.assertRaises(ValueError) as caught:
                g.allocate(capacity_tokens=8)
            self.assertIn("hidden_size: required (or make the Group with Group.from_model)",
                          str(caught.exception))


if __name__ == "__main__":
    unittest.main()
