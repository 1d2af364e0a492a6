"""benchmarks/train_profile.py's summary by kind (``by_kind``) on kernel names taken from a
real profile of both sides (the thirty-eighth session's, results/gpu-2026-12-07-s38/call2):
each name lands in the kind the RESULTS table reads it as. Runs without a GPU."""
import pytest

import _scripts


@pytest.fixture(scope="module")
def tp():
    return _scripts.load("benchmarks/train_profile.py")


FORGE = {
    "flash_bwd_dkdv_wgmma_kvs_r128h_bf16_h64": 5.045,
    "flash_bwd_dq_wgmma_qds_r128_bf16_h64": 3.505,
    "flash_fwd_wgmma_r128_bf16_h64": 2.751,
    "nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_splitK_NTN": 4.761,
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_aux_bf16_"
    "dgelu_execute_segment_k_off_kernel__5x_cublas": 3.635,
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": 0.292,
    "cross_entropy_fused_stream_bf16_i64": 2.409,
    "layernorm_bwd_fused_add_sums_bf16_3": 1.965,
    "layernorm_fwd_vec_bf16_3": 0.824,
    "adamw_update_f32_bf16": 1.565,
    "sum_rows8_partial_bf16": 0.866,
    "Memset (Device)": 0.137,
}
COMPILE = {
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_"
    "kernel0_0": 5.394,
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)": 0.908,
    "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)": 0.696,
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_"
    "kernel0_0": 1.990,
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": 7.919,
    "triton_poi_fused__log_softmax__log_softmax_backward_data__to_copy_nll_loss_backward": 4.723,
    "triton_per_fused__to_copy_add_native_layer_norm_backward_view_10": 3.033,
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
    "FusedOptimizerTensorListMetadata<4>>": 1.308,
    "triton_poi_fused_gelu_gelu_backward_view_7": 2.360,
}


def test_forge_kernels_by_kind(tp):
    got = tp.by_kind(FORGE)
    want = {"attention backward": 8.55, "attention forward": 2.751, "products": 8.688,
            "cross-entropy": 2.409, "layernorm": 2.789, "optimizer": 1.565, "other": 1.003}
    assert list(got) == list(want)          # the table's order: KINDS', then "other"
    assert got == pytest.approx(want, abs=1e-9)
    assert sum(got.values()) == pytest.approx(sum(FORGE.values()))


def test_torch_compile_kernels_by_kind(tp):
    got = tp.by_kind(COMPILE)
    assert got["attention backward"] == pytest.approx(5.394 + 0.908 + 0.696)
    assert got["attention forward"] == pytest.approx(1.990)
    assert got["products"] == pytest.approx(7.919)
    assert got["cross-entropy"] == pytest.approx(4.723)
    assert got["layernorm"] == pytest.approx(3.033)
    assert got["optimizer"] == pytest.approx(1.308)
    assert got["other"] == pytest.approx(2.360)     # Inductor's GELU, apart from the products
