//! The facts topic's messages read into the reference's facts (`stream_app/worker/facts.py`:
//! `decode_facts`), for the folds across runs' agent.
//!
//! A facts message is `{"v": 1, "trees": [item, ...], "threads": [...], "tools": [...]}`, each item
//! `[source partition, offset, *fields]`. The reference reads it with orjson and checks each item's
//! types in Python: the checks were ~70% of its decode, and the decode ~40% of the agent's time on the
//! bench's trees (py-spy, 2026-12-07). `FactsReader::read` builds the same `(kind, source partition, offset, fact)` tuples
//! from the text, each fact its kind's named tuple. It reads only what it is sure the reference reads
//! alike: anything else (not JSON, a format or a field it does not take for certain, a number that is
//! not a 64-bit integer, an item of an earlier release's shape, a repeated name) gives None, and the
//! caller reads the message with the reference, which refuses it with its reason or reads it.
//!
//! What each field may hold comes from the reference (`Kind.codes`, from the facts' annotations), so
//! the two cannot drift apart silently: a field this reader does not know makes it decline.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyString, PyTuple, PyType};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// A field may hold an integer (a bool is not one).
pub const INT: u8 = 1;
/// A string.
pub const STR: u8 = 2;
/// A bool.
pub const BOOL: u8 = 4;
/// null.
pub const NULL: u8 = 8;
/// A list of strings (the fact holds a tuple).
pub const STRS: u8 = 16;
/// A list of integers (the fact holds a tuple).
pub const INTS: u8 = 32;

/// `FactsReader::new`'s description of a kind: (the `Kind`, its message field, its fact class, its codes).
type KindArgs = (Py<PyAny>, String, Py<PyAny>, Vec<u8>);

/// One kind of fact: its `Kind` object, its field in a message, its named tuple and its item's codes.
struct KindOf {
    kind: Py<PyAny>,
    name: String,
    fact: Py<PyAny>,
    codes: Vec<u8>,
}

/// Reads facts messages of one format into the reference's facts.
#[pyclass(frozen)]
pub struct FactsReader {
    format: i64,
    kinds: Vec<KindOf>,
}

#[pymethods]
impl FactsReader {
    /// ``kinds``: (the ``Kind``, its message field, its fact class, its item's codes: ``INT`` | ``STR`` |
    /// ... per field, source partition and offset first).
    #[new]
    fn new(py: Python<'_>, format: i64, kinds: Vec<KindArgs>) -> PyResult<Self> {
        let tuple = py.get_type::<PyTuple>();
        for (_, name, fact, codes) in &kinds {
            if !fact
                .bind(py)
                .cast::<PyType>()
                .is_ok_and(|class| class.is_subclass(&tuple).unwrap_or(false))
            {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "{name}: a fact is a named tuple"
                )));
            }
            if codes.len() < 2 || codes[0] != INT || codes[1] != INT {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "{name}: an item starts with its source partition and offset (integers)"
                )));
            }
        }
        Ok(FactsReader {
            format,
            kinds: kinds
                .into_iter()
                .map(|(kind, name, fact, codes)| KindOf {
                    kind,
                    name,
                    fact,
                    codes,
                })
                .collect(),
        })
    }

    /// The facts of ``value`` as ``decode_facts`` gives them, or None where this reader declines (the
    /// reference then reads it).
    fn read<'py>(&self, py: Python<'py>, value: &[u8]) -> PyResult<Option<Bound<'py, PyList>>> {
        let mut deserializer = serde_json::Deserializer::from_slice(value);
        let read = Message { reader: self, py }.deserialize(&mut deserializer);
        let Ok(mut by_kind) = read else {
            return Ok(None);
        };
        if deserializer.end().is_err() {
            return Ok(None);
        }
        let out = PyList::empty(py);
        for facts in by_kind.iter_mut() {
            for fact in facts.drain(..) {
                out.append(fact)?;
            }
        }
        Ok(Some(out))
    }
}

/// Declined: what the reference reads instead (never shown).
fn decline<E: de::Error>() -> E {
    E::custom("declined")
}

/// A whole message: each kind's facts, in `FactsReader::kinds` order.
struct Message<'r, 'py> {
    reader: &'r FactsReader,
    py: Python<'py>,
}

impl<'de, 'py> DeserializeSeed<'de> for Message<'_, 'py> {
    type Value = Vec<Vec<Bound<'py, PyTuple>>>;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, 'py> Visitor<'de> for Message<'_, 'py> {
    type Value = Vec<Vec<Bound<'py, PyTuple>>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a facts message")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let kinds = &self.reader.kinds;
        let mut by_kind: Vec<Option<Vec<Bound<'py, PyTuple>>>> =
            kinds.iter().map(|_| None).collect();
        let mut format = None;
        // a name with an escape is no borrowed string: declined (a repeated name too: orjson keeps the last)
        while let Some(name) = map.next_key::<&'de str>()? {
            if name == "v" {
                if format.is_some() {
                    return Err(decline());
                }
                format = Some(map.next_value::<Value>()?);
            } else if let Some(index) = kinds.iter().position(|kind| kind.name == name) {
                if by_kind[index].is_some() {
                    return Err(decline());
                }
                by_kind[index] = Some(map.next_value_seed(Items {
                    kind: &kinds[index],
                    py: self.py,
                })?);
            } else {
                map.next_value::<de::IgnoredAny>()?;
            }
        }
        match format {
            Some(Value::Number(v)) if v.as_i64() == Some(self.reader.format) => {}
            _ => return Err(decline()),
        }
        Ok(by_kind.into_iter().map(Option::unwrap_or_default).collect())
    }
}

/// One kind's items: `(kind, source partition, offset, fact)` each.
struct Items<'k, 'py> {
    kind: &'k KindOf,
    py: Python<'py>,
}

impl<'de, 'py> DeserializeSeed<'de> for Items<'_, 'py> {
    type Value = Vec<Bound<'py, PyTuple>>;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, 'py> Visitor<'de> for Items<'_, 'py> {
    type Value = Vec<Bound<'py, PyTuple>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of facts")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Self::Value, A::Error> {
        let py = self.py;
        let codes = &self.kind.codes;
        let mut out = Vec::with_capacity(items.size_hint().unwrap_or(16));
        let kind = self.kind.kind.bind(py);
        let fact_class = self
            .kind
            .fact
            .bind(py)
            .cast::<PyType>()
            .map_err(|_| decline::<A::Error>())?;
        let mut fields: Vec<Bound<'py, PyAny>> = Vec::with_capacity(codes.len());
        while items
            .next_element_seed(Item {
                codes,
                py,
                fields: &mut fields,
            })?
            .is_some()
        {
            let mut fields = fields.drain(..);
            let (partition, offset) = (
                fields.next().expect("two codes"),
                fields.next().expect("two codes"),
            );
            let fact = named_tuple(py, fact_class, fields).map_err(|_| decline::<A::Error>())?;
            out.push(
                PyTuple::new(py, [kind.clone(), partition, offset, fact])
                    .map_err(|_| decline::<A::Error>())?,
            );
        }
        Ok(out)
    }
}

/// An instance of `class` (a subclass of tuple: a named tuple) holding `fields`, as `tuple.__new__(class,
/// fields)` makes it (CPython's `tuple_subtype_new`: the type's allocation, each item set) without the
/// call's argument tuple and the iteration over it: the call was about a quarter of the reader's time.
fn named_tuple<'py>(
    py: Python<'py>,
    class: &Bound<'py, PyType>,
    fields: impl ExactSizeIterator<Item = Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let size = fields.len();
    // SAFETY: `class` is a tuple subclass (checked by `FactsReader::new`): its `tp_alloc` makes a tuple of
    // `size` empty items (NULL, as the GC's traversal of a tuple allows), refcount 1, and
    // `PyTuple_SetItem` fills each once, stealing its reference.
    unsafe {
        let alloc: ffi::allocfunc =
            std::mem::transmute(ffi::PyType_GetSlot(class.as_type_ptr(), ffi::Py_tp_alloc));
        let object = alloc(class.as_type_ptr(), size as ffi::Py_ssize_t);
        if object.is_null() {
            return Err(PyErr::fetch(py));
        }
        let object = Bound::from_owned_ptr(py, object);
        for (index, field) in fields.enumerate() {
            if ffi::PyTuple_SetItem(object.as_ptr(), index as ffi::Py_ssize_t, field.into_ptr())
                != 0
            {
                return Err(PyErr::fetch(py));
            }
        }
        Ok(object)
    }
}

/// One item's fields, each as its code allows, into `fields`.
struct Item<'c, 'f, 'py> {
    codes: &'c [u8],
    py: Python<'py>,
    fields: &'f mut Vec<Bound<'py, PyAny>>,
}

impl<'de> DeserializeSeed<'de> for Item<'_, '_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Item<'_, '_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a fact")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut fields: A) -> Result<(), A::Error> {
        for &code in self.codes {
            match fields.next_element_seed(Field { code, py: self.py })? {
                Some(field) => self.fields.push(field),
                None => return Err(decline()), // too short (an earlier release's item: the reference reads it)
            }
        }
        match fields.next_element::<de::IgnoredAny>()? {
            None => Ok(()),
            Some(_) => Err(decline()),
        }
    }
}

/// One field, if it holds what `code` allows.
struct Field<'py> {
    code: u8,
    py: Python<'py>,
}

impl<'de, 'py> DeserializeSeed<'de> for Field<'py> {
    type Value = Bound<'py, PyAny>;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, 'py> Visitor<'de> for Field<'py> {
    type Value = Bound<'py, PyAny>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a fact's field")
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        if self.code & INT == 0 {
            return Err(decline());
        }
        Ok(v.into_pyobject(self.py)
            .map_err(|_| decline::<E>())?
            .into_any())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        match i64::try_from(v) {
            Ok(v) => self.visit_i64(v),
            Err(_) => Err(decline()), // past 64-bit signed: the reference judges it
        }
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Err(decline())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        if self.code & STR == 0 {
            return Err(decline());
        }
        Ok(PyString::new(self.py, v).into_any())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        if self.code & BOOL == 0 {
            return Err(decline());
        }
        Ok(PyBool::new(self.py, v).to_owned().into_any())
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        if self.code & NULL == 0 {
            return Err(decline());
        }
        Ok(self.py.None().into_bound(self.py))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut elements: A) -> Result<Self::Value, A::Error> {
        let element = if self.code & STRS != 0 {
            STR
        } else if self.code & INTS != 0 {
            INT
        } else {
            return Err(decline());
        };
        let mut out = Vec::with_capacity(elements.size_hint().unwrap_or(8));
        while let Some(object) = elements.next_element_seed(Field {
            code: element,
            py: self.py,
        })? {
            out.push(object);
        }
        Ok(PyTuple::new(self.py, out)
            .map_err(|_| decline::<A::Error>())?
            .into_any())
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(decline())
    }
}
