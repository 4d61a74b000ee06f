#pragma once
/// `std::visit(Overloaded{[](const A&) {...}, [](const B&) {...}}, variant)`: one lambda per
/// alternative of a std::variant.

namespace troupe {

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

}  // namespace troupe
