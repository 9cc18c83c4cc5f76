#include "moekit/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <type_traits>

#include "moekit/core/device_arena.h"
#include "moekit/core/device_memory.h"

namespace moekit {

std::string device_name(Device device) {
  if (device.is_cpu()) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

Device parse_device(std::string_view name) {
  if (name == "cpu") return Device::cpu();
  if (name == "cuda") return Device::cuda(0);
  if (name.starts_with("cuda:")) {
    const std::string index(name.substr(5));
    char* end = nullptr;
    const long value = std::strtol(index.c_str(), &end, 10);
    MOEKIT_CHECK(!index.empty() && *end == '\0' && value >= 0, "bad device '", name, "'; expected cpu, cuda or cuda:N");
    return Device::cuda(static_cast<int>(value));
  }
  MOEKIT_FAIL("unknown device '", name, "'; expected cpu, cuda or cuda:N");
}

Storage::Storage(void* data, std::size_t bytes, Device device, std::function<void(void*)> deleter)
    : data_(data), bytes_(bytes), device_(device), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  attachments_.clear();
  if (deleter_) deleter_(data_);
}

std::shared_ptr<void> Storage::attachment(const std::string& key, const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = attachments_.find(key);
  if (it != attachments_.end()) return it->second;
  auto value = make();
  attachments_.emplace(key, value);
  return value;
}

void Storage::clear_attachments() {
  std::lock_guard<std::mutex> lock(mutex_);
  attachments_.clear();
}

std::string shape_string(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

namespace {

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t stride = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

int64_t checked_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    MOEKIT_CHECK(s >= 0, "negative dimension in shape ", shape_string(shape));
    MOEKIT_CHECK(s == 0 || n <= (int64_t{1} << 62) / s, "shape ", shape_string(shape), " is too large");
    n *= s;
  }
  return n;
}

}  // namespace

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  const std::size_t bytes = static_cast<std::size_t>(checked_numel(shape)) * dtype_size(dtype);
  Tensor t;
  t.storage_ = device_storage(bytes, device);  // from a graph's own memory while one is being captured
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  t.fill_bytes(0);
  return t;
}

namespace {

// Elements a strided view reaches, from its first to its last (0 when empty); checks the strides.
int64_t view_extent(const Shape& shape, const Shape& strides, const char* what) {
  const int64_t n = checked_numel(shape);
  MOEKIT_CHECK(strides.size() == shape.size(), what, ": strides ", shape_string(strides), " do not match shape ",
               shape_string(shape));
  int64_t extent = n == 0 ? 0 : 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    MOEKIT_CHECK(strides[i] >= 0, what, ": negative strides are not supported");
    if (n != 0) extent += (shape[i] - 1) * strides[i];
  }
  return extent;
}

}  // namespace

Tensor Tensor::from_blob(void* data, Shape shape, DType dtype, Device device, Shape strides) {
  if (strides.empty()) strides = contiguous_strides(shape);
  const int64_t extent = view_extent(shape, strides, "from_blob");
  MOEKIT_CHECK(data != nullptr || extent == 0, "from_blob: null data for a non-empty tensor");
  Tensor t;
  t.storage_ = std::make_shared<Storage>(data, static_cast<std::size_t>(extent) * dtype_size(dtype), device,
                                         std::function<void(void*)>());
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::from_storage(std::shared_ptr<Storage> storage, std::size_t offset_bytes, Shape shape, DType dtype,
                            Shape strides) {
  MOEKIT_CHECK(storage != nullptr, "from_storage: null storage");
  if (strides.empty()) strides = contiguous_strides(shape);
  const int64_t extent = view_extent(shape, strides, "from_storage");
  const auto bytes = static_cast<std::size_t>(extent) * dtype_size(dtype);
  MOEKIT_CHECK(offset_bytes <= storage->bytes() && bytes <= storage->bytes() - offset_bytes,
               "from_storage: ", dtype_name(dtype), shape_string(shape), " at byte ", offset_bytes,
               " overruns a storage of ", storage->bytes(), " bytes");
  Tensor t;
  t.device_ = storage->device();
  t.storage_ = std::move(storage);
  t.offset_bytes_ = offset_bytes;
  t.strides_ = std::move(strides);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  return t;
}

int64_t Tensor::size(int64_t d) const {
  if (d < 0) d += dim();
  MOEKIT_CHECK(d >= 0 && d < dim(), "dimension ", d, " out of range for ", describe());
  return shape_[static_cast<std::size_t>(d)];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

void* Tensor::data() const {
  MOEKIT_CHECK(defined(), "access to an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_bytes_;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  if (d < 0) d += dim();
  MOEKIT_CHECK(d >= 0 && d < dim(), "slice: dimension ", d, " out of range for ", describe());
  const auto i = static_cast<std::size_t>(d);
  MOEKIT_CHECK(0 <= start && start <= end && end <= shape_[i], "slice [", start, ", ", end, ") out of range for ",
               describe());
  Tensor t = *this;
  t.offset_bytes_ += static_cast<std::size_t>(start * strides_[i]) * dtype_size(dtype_);
  t.shape_[i] = end - start;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  if (d < 0) d += dim();
  Tensor t = slice(d, index, index + 1);
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  MOEKIT_CHECK(is_contiguous(), "reshape needs a contiguous tensor, got ", describe());
  MOEKIT_CHECK(checked_numel(shape) == numel(), "reshape ", describe(), " to ", shape_string(shape),
               " changes the element count");
  Tensor t = *this;
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  if (d0 < 0) d0 += dim();
  if (d1 < 0) d1 += dim();
  MOEKIT_CHECK(d0 >= 0 && d0 < dim() && d1 >= 0 && d1 < dim(), "transpose dims out of range for ", describe());
  Tensor t = *this;
  std::swap(t.shape_[static_cast<std::size_t>(d0)], t.shape_[static_cast<std::size_t>(d1)]);
  std::swap(t.strides_[static_cast<std::size_t>(d0)], t.strides_[static_cast<std::size_t>(d1)]);
  return t;
}

namespace {

// Calls fn(offset_in_elements) for every element in row-major order of the logical shape.
template <typename Fn>
void for_each_offset(const Shape& shape, const Shape& strides, Fn&& fn) {
  const int64_t n = checked_numel(shape);
  if (n == 0) return;
  std::vector<int64_t> index(shape.size(), 0);
  int64_t offset = 0;
  for (int64_t linear = 0; linear < n; ++linear) {
    fn(offset);
    for (std::size_t d = shape.size(); d-- > 0;) {
      if (++index[d] < shape[d]) {
        offset += strides[d];
        break;
      }
      offset -= (shape[d] - 1) * strides[d];
      index[d] = 0;
    }
  }
}

}  // namespace

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  MOEKIT_CHECK(device_.is_cpu(), "clone is implemented on the CPU only, got ", describe());
  Tensor out = empty(shape_, dtype_, device_);
  const std::size_t es = dtype_size(dtype_);
  const char* src = static_cast<const char*>(data());
  char* dst = static_cast<char*>(out.data());
  if (is_contiguous()) {
    std::memcpy(dst, src, nbytes());
    return out;
  }
  for_each_offset(shape_, strides_, [&](int64_t offset) {
    std::memcpy(dst, src + offset * static_cast<int64_t>(es), es);
    dst += es;
  });
  return out;
}

Tensor Tensor::to(DType dtype) const {
  MOEKIT_CHECK(device_.is_cpu(), "dtype conversion is implemented on the CPU only, got ", describe());
  if (dtype == dtype_) return contiguous();
  Tensor src = contiguous();
  Tensor out = empty(shape_, dtype, device_);
  const int64_t n = numel();
  // Values pass through double, which holds every value of every source dtype exactly. Packed f4_e2m1
  // pairs and raw u8 bytes have no element-wise value; dequantize_weights (quantization.h) unpacks FP4.
  visit_dtype_among<float, f16, bf16, f8_e4m3, ue8m0, int32_t, int64_t>(
      dtype_, "a dtype with one value per element to convert from (not u8 bytes or packed f4_e2m1 pairs)",
      [&](auto source_tag) {
        using S = typename decltype(source_tag)::type;
        const S* s = static_cast<const S*>(src.data());
        auto value = [s](int64_t i) {
          if constexpr (std::is_integral_v<S>)
            return static_cast<double>(s[i]);
          else
            return static_cast<double>(to_float(s[i]));
        };
        visit_dtype_among<float, f16, bf16, f8_e4m3, ue8m0, int32_t, int64_t>(
            dtype, "a floating dtype (f32, f16, bf16, f8_e4m3, ue8m0) or an index dtype (i32, i64) to convert to",
            [&](auto target_tag) {
              using D = typename decltype(target_tag)::type;
              D* d = static_cast<D*>(out.data());
              for (int64_t i = 0; i < n; ++i) {
                if constexpr (std::is_integral_v<D>)
                  d[i] = static_cast<D>(value(i));  // truncates toward zero, as a C++ cast (and torch) does
                else
                  d[i] = from_float<D>(static_cast<float>(value(i)));
              }
            });
      });
  return out;
}

Tensor Tensor::to(Device device) const {
  if (device == device_) return *this;
  Tensor src = device_.is_cpu() ? contiguous() : *this;
  MOEKIT_CHECK(src.is_contiguous(), "copy between devices needs a contiguous tensor, got ", describe());
  Tensor out = empty(shape_, dtype_, device);
  device_copy(out.data(), device, src.data(), device_, nbytes());
  return out;
}

void Tensor::fill_bytes(uint8_t value) {
  MOEKIT_CHECK(is_contiguous(), "fill_bytes needs a contiguous tensor, got ", describe());
  device_memset(data(), value, nbytes(), device_);
}

void Tensor::mark_modified() const {
  if (storage_) storage_->clear_attachments();
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  std::ostringstream os;
  os << dtype_name(dtype_) << shape_string(shape_) << " on " << device_name(device_);
  return os.str();
}

}  // namespace moekit
